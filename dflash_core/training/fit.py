"""Train a drafter on accumulated data shards: ``python -m dflash_core.training.fit --data runs/data --out runs/fit``.

Uses the target features kept at generation time (no teacher-forced pass), optionally a reduced draft vocabulary
(``--draft-vocab 16384``: the most frequent tokens of the target's own responses; the loss is then the drafter's exact
softmax over it), and optionally starts from an existing drafter (``--init``). Resumable: a rerun with the same
``--out`` continues from ``checkpoint.pt``. Writes ``drafter/`` (bf16, z-lab format plus ``draft_vocab``) and
``summary.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping
from pathlib import Path

import torch

from ..files import write_text_atomic
from ..model import MARKOV_KINDS, DFlashDraftModel, attach_markov_head, load_draft
from .train_config import DraftSpec, TrainConfig, make_draft_config
from .corpus import build_draft_vocab, load_corpus, vocab_coverage
from .evaluate import replay_evaluator, tau_evaluator
from .loop import export_drafter, init_distributed, load_checkpoint, setup_logging, train

__all__ = ["TrainingData", "load_training_data", "main"]


@dataclass
class TrainingData:
    sequences: list[tuple[torch.Tensor, int]]  # training (ids, prompt length), held-out samples removed
    responses: list[list[int]]  # their response ids (for the draft vocabulary)
    eval_prompts: list[list[int]]  # prompt ids of the held-out samples (tau evaluation during training)
    held_responses: list[list[int]]
    has_features: bool  # every sequence has target features kept at generation time
    _sources: list = field(default_factory=list, repr=False)  # (corpus, index) per training sequence

    layer_ids: list[int] | None = None  # the drafter's taps (set before training): selects the kept columns

    def feature_source(self, j: int):
        corpus, i = self._sources[j]
        return corpus.feature_source(i, self.layer_ids)

    @property
    def response_tokens(self) -> int:
        return sum(len(r) for r in self.responses)


def load_training_data(folders, tokenizer, seed: int = 0, eval_prompts: int = 6, log=print) -> TrainingData:
    """Every complete shard of ``folders``, minus ``eval_prompts`` samples held out (spread over the sources)."""
    corpora = [load_corpus(d, tokenizer, seed) for d in folders]
    sequences, sources, responses, refs = [], [], [], []
    for folder, c in zip(folders, corpora):
        if not c.has_features:  # e.g. the committed token shards: features come from a teacher-forced pass
            log(f"data: some shards in {folder} keep no features; a teacher-forced target pass "
                "computes them on first use")
        log(f"data: {len(c.sequences)} sequences from {folder} ({c.skipped} skipped), base {len(sequences)}")
        sequences += c.sequences
        sources += c.sources
        responses += c.responses
        refs += [(c, i) for i in range(len(c.sequences))]
    rng = random.Random(f"holdout:{seed}")
    by_source: dict[str, list[int]] = {}
    for i, src in enumerate(sources):
        by_source.setdefault(src, []).append(i)
    held: set[int] = set()
    while len(held) < min(eval_prompts, len(sequences)):
        for src in sorted(by_source):
            if len(held) < eval_prompts:
                held.add(rng.choice(by_source[src]))
    train_idx = [i for i in range(len(sequences)) if i not in held]
    data = TrainingData([sequences[i] for i in train_idx], [responses[i] for i in train_idx],
                        [sequences[i][0][: sequences[i][1]].tolist() for i in sorted(held)],
                        [responses[i] for i in sorted(held)], all(c.has_features for c in corpora),
                        [refs[i] for i in train_idx])
    log(f"data: {len(data.sequences)} training sequences, {data.response_tokens} response tokens, "
        f"{len(held)} held out")
    return data


# Hyper-parameter sets (fit's argument defaults): the shipped drafter's, and the published DFlash recipe for
# Qwen3-class targets on GPUs (DDP under torchrun: 5 layers, 512 anchors of 16 per sequence, 3,072-token sequences).
FIT_PRESETS: Mapping[str, dict] = MappingProxyType({
    "smollm2": {},
    "qwen3": dict(layers=5, taps=5, block_size=16, gamma=7.0, lr=6e-4, warmup_frac=0.04, anchors=512,
                  seqs_per_step=32, max_len=3072, distill_weight=0.5, loss_vocab="full", eval_every=1000),
})


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dflash_core.training.fit", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(FIT_PRESETS), default="smollm2",
                   help="hyper-parameter defaults (explicit options override them)")
    p.add_argument("--data", required=True, action="append", help="shard folder (repeatable)")
    p.add_argument("--out", required=True)
    p.add_argument("--target", default="smollm2", help="'smollm2' (embedded) or the Hugging Face id / folder the "
                   "shards were generated with")
    p.add_argument("--device", default="auto", help="auto (CUDA when available; under torchrun the rank's GPU), cpu, cuda")
    p.add_argument("--init", help="start from this drafter folder (same shape) instead of random weights")
    p.add_argument("--export", help="also copy the final drafter into this folder")
    p.add_argument("--draft-vocab", type=int, default=0, help="reduced draft vocabulary size (0: full vocabulary)")
    p.add_argument("--loss-vocab", default=None, help="'draft' (default with --draft-vocab), 'full' or 'batch'")
    p.add_argument("--minutes", type=float, default=None, help="training time budget (the schedule follows it)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--taps", type=int, default=5)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--mask-token-id", type=int, default=16)
    p.add_argument("--gamma", type=float, default=7.0)
    p.add_argument("--anchors", type=int, default=48)
    p.add_argument("--seqs-per-step", type=int, default=8)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup-frac", type=float, default=0.04)
    p.add_argument("--distill-weight", type=float, default=0.5)
    p.add_argument("--max-len", type=int, default=768)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-prompts", type=int, default=6)
    p.add_argument("--markov-rank", type=int, default=0,
                   help="give the drafter a Markov head of this rank (0: none; an --init drafter's head is kept)")
    p.add_argument("--markov-kind", choices=MARKOV_KINDS, default="token")
    p.add_argument("--no-feature-cache", action="store_true",
                   help="do not keep recomputed target features in memory (a run shorter than one epoch never "
                        "reuses them; a long run over token-only shards needs ~6 KB per token)")
    p.add_argument("--train-only", choices=["all", "markov"], default="all",
                   help="'markov': train the Markov head alone, the drafter's layers frozen")
    p.add_argument("--eval", choices=["replay", "live"], default="replay",
                   help="tau during training: replayed from greedy continuations (fast) or the live decode loop")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    preset = p.parse_known_args(argv)[0].preset
    p.set_defaults(**FIT_PRESETS[preset])
    return p.parse_args(argv)


def build_drafter(a: argparse.Namespace, target, data, stops, out: Path, log):
    """The drafter to train (random, or from --init) with its draft vocabulary; returns (drafter, coverage)."""
    spec = DraftSpec(layers=a.layers, taps=a.taps, block_size=a.block_size, mask_token_id=a.mask_token_id)
    torch.manual_seed(a.seed)
    if a.init:
        draft = load_draft(a.init, dtype=torch.float32)
        log(f"drafter: initialised from {a.init}")
    else:
        draft = DFlashDraftModel(make_draft_config(target.config, spec))
    coverage = None
    inherited = draft.draft_vocab if a.init else None  # a drafter's vocabulary belongs to its head: keep it
    if inherited is not None and a.draft_vocab in (0, len(inherited)):
        a.draft_vocab = len(inherited)
    if a.draft_vocab:
        resumed = (load_checkpoint(out / "checkpoint.pt")["draft"].get("draft_vocab")
                   if (out / "checkpoint.pt").is_file() else None)
        # a resumed run keeps the vocabulary it started with (the data may have grown since), as does a run from
        # --init (its head rows were trained for that vocabulary)
        vocab = resumed if resumed is not None else inherited if inherited is not None and \
            len(inherited) == a.draft_vocab else build_draft_vocab(data.responses, a.draft_vocab, always=stops)
        draft.set_draft_vocab(vocab)
        coverage = vocab_coverage(data.held_responses or data.responses[:50], vocab)
        log(f"draft vocabulary: {len(vocab)} ids, held-out token coverage {coverage:.4f}")
    if a.markov_rank and draft.markov is None:
        attach_markov_head(draft, a.markov_rank, a.markov_kind)
        log(f"markov head: rank {a.markov_rank}, kind {a.markov_kind} (new, zero output: starts as the drafter)")
    if a.train_only == "markov":
        if draft.markov is None:
            raise SystemExit("--train-only markov needs a Markov head: pass --markov-rank or an --init drafter with one")
        for name, p in draft.named_parameters():
            p.requires_grad_(name.startswith("markov."))
    log(f"drafter: {sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M parameters "
        f"({sum(p.numel() for p in draft.parameters() if p.requires_grad) / 1e6:.2f}M trained), "
        f"taps {list(draft.config.target_layer_ids)}")
    return draft, coverage


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    out = Path(a.out)
    rank = int(os.environ.get("RANK", "0"))  # under torchrun every rank trains; rank 0 logs and writes
    logger = setup_logging(out, rank)
    log = logger.info
    log(f"options: {json.dumps(vars(a), sort_keys=True)}")
    from ..loading import load_target

    t0 = time.perf_counter()
    device, distributed = init_distributed(None if a.device == "auto" else a.device)
    target, tokenizer, stops = load_target(a.target, torch.bfloat16, device)
    data = load_training_data(a.data, tokenizer, a.seed, a.eval_prompts, log)
    eval_prompts, n_tokens = data.eval_prompts, data.response_tokens

    draft, coverage = build_drafter(a, target, data, stops, out, log)
    loss_vocab = a.loss_vocab or ("draft" if a.draft_vocab else "batch")
    cfg = TrainConfig(gamma=a.gamma, anchors=a.anchors, seqs_per_step=a.seqs_per_step, lr=a.lr,
                      warmup_frac=a.warmup_frac, steps=a.steps, max_len=a.max_len, distill_weight=a.distill_weight,
                      distill_topk=8, loss_vocab=loss_vocab, eval_every=a.eval_every, eval_prompts=a.eval_prompts,
                      eval_new_tokens=64, seed=a.seed,
                      cache_features=not data.has_features and not a.no_feature_cache,  # keep recomputed ones
                      time_budget_s=a.minutes * 60 if a.minutes else None)
    make_eval = replay_evaluator if a.eval == "replay" else (
        lambda t, p, n, s: tau_evaluator(t, tokenizer, p, n, s))
    evaluate = make_eval(target, eval_prompts, cfg.eval_new_tokens, stops) if eval_prompts else None

    data.layer_ids = list(draft.config.target_layer_ids)
    state = train(target, draft, data.sequences, cfg, out, log, evaluate, feature_source=data.feature_source)
    if distributed:
        import torch.distributed as dist

        dist.destroy_process_group()
    if rank != 0:
        return
    final = out / "drafter"
    draft.save_pretrained(final, dtype=torch.bfloat16)
    tail = state.history[-50:]
    summary = {"steps": state.step, "train_minutes": state.train_seconds / 60,
               "final_loss_last50": sum(h["loss"] for h in tail) / max(1, len(tail)),
               "final_acc1_last50": sum(h["acc1"] for h in tail) / max(1, len(tail)),
               "best_eval_tau": state.best_tau, "sequences": len(data.sequences), "response_tokens": n_tokens,
               "draft_vocab": a.draft_vocab or None, "draft_vocab_coverage": coverage,
               "options": vars(a), "total_minutes": (time.perf_counter() - t0) / 60,
               "history": [{k: h[k] for k in h if k in ("step", "loss", "acc1", "tau")} for h in state.history
                           if h["step"] % 25 == 0 or "tau" in h]}
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    if a.export:
        export_drafter(final, a.export, log)
    log(f"done: steps {state.step}, loss {summary['final_loss_last50']:.4f}, best tau {state.best_tau:.3f}")


if __name__ == "__main__":
    main()
