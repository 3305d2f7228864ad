"""Train a drafter's Markov head alone: ``python -m dflash_core.training.markov_fit --init <drafter> --data <shards>
--out <dir> --rank 128 --kind gated --minutes 15``.

With the drafter's layers frozen, everything the head's loss needs at a predicted block position is fixed by the
data: the drafter's output state there, the token before it (teacher-forced: the target's own), the target's token
and its top-k distribution. So the expensive part (one teacher-forced target pass and one drafter pass per sequence)
runs once, over as many sequences as the first ``--collect`` share of the time allows, and the head then trains for
many epochs on the stored positions, each step one [batch, hidden] x [hidden, V'] product for the drafter's own
logits plus the head. The loss is the drafter's (:mod:`.loss`): position weights exp(-(k-1)/gamma), half the
hard-label cross-entropy and half the cross-entropy against the target's renormalised top-k; a position whose label
lies outside the draft vocabulary keeps its soft term (it cannot be drafted, but its distribution still teaches).
Batches are whole blocks; ``--steps`` fixes the work of arms compared on a busy machine.
Writes ``drafter/`` (the drafter with its head, bf16) and ``summary.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

from ..files import save_atomic, write_text_atomic
from ..model import MARKOV_KINDS, attach_markov_head, draft_index
from ..model import load_draft
from ..target import tapped_forward
from .anchors import position_weights, sample_anchors
from .train_config import TrainConfig
from .loss import SequenceFeatures, _predicted_hidden

__all__ = ["collect_positions", "train_head", "main"]


@torch.no_grad()
def batch_features(target, seqs: list[torch.Tensor], layer_ids, topk: int) -> list[SequenceFeatures]:
    """:func:`.loss.target_features` of several sequences from ONE target forward: right-padded to the longest (a
    causal model's outputs at the real positions do not see the padding), so no attention mask is needed."""
    longest = max(len(s) for s in seqs)
    batch = torch.zeros(len(seqs), longest, dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = s
    device = target.lm_head.weight.device
    out = tapped_forward(target, batch.to(device), layer_ids, use_cache=False)
    feats = out.features  # [n, L, taps*H]
    top_logp, top_ids = torch.log_softmax(out.logits.float(), dim=-1).topk(topk, dim=-1)  # [n, L, k]
    return [SequenceFeatures(feats[i, : len(s)].clone(), top_ids[i, : len(s)], top_logp[i, : len(s)])
            for i, s in enumerate(seqs)]


@torch.no_grad()
def collect_positions(target, draft, sequences, deadline: float, anchors: int = 48, gamma: float = 7.0,
                      topk: int = 8, seed: int = 0, batch: int = 8, log=print) -> dict[str, torch.Tensor]:
    """Predicted positions of ``sequences`` [(ids, prompt_len)] (in order) until ``deadline`` (perf_counter):
    states [N, H] bf16, prev / label draft indices [N] (label -1 outside the draft vocabulary), soft ids [N, k]
    (-1 outside), soft probabilities [N, k] and position weights [N]."""
    cfg = TrainConfig(anchors=anchors, gamma=gamma, autocast=True)
    dev = target.lm_head.weight.device
    embed = target.model.embed_tokens
    weights_k = position_weights(draft.block_size, gamma)
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("states", "prev", "label", "soft_ids", "soft_p", "w")}
    g = torch.Generator().manual_seed(seed)
    n_seq = 0
    for lo in range(0, len(sequences), batch):
        if time.perf_counter() > deadline:
            break
        group = sequences[lo: lo + batch]
        for (ids, prompt_len), feats in zip(group, batch_features(target, [s for s, _ in group],
                                                                  draft.config.target_layer_ids, topk)):
            _collect_one(draft, embed, ids, prompt_len, feats, cfg, dev, weights_k, parts, g)
        n_seq += len(group)
        if n_seq % 200 < batch:
            log(f"collect: {n_seq} sequences, {sum(len(p) for p in parts['w'])} positions")
    out = {k: torch.cat(v) for k, v in parts.items()}
    out["sequences"] = torch.tensor(n_seq)
    return out


def _collect_one(draft, embed, ids, prompt_len, feats, cfg, dev, weights_k, parts, g) -> None:
    """One sequence's predicted positions (see :func:`collect_positions`) appended to ``parts``."""
    b = draft.block_size
    anchor = sample_anchors(prompt_len, len(ids), cfg.anchors, g)
    if len(anchor):
        hidden, labels, valid = _predicted_hidden(draft, embed, ids, feats, anchor, cfg, dev, torch.float32)
        src = (anchor[:, None] + torch.arange(b - 1))[valid]  # [N] the position before each label
        parts["states"].append(hidden.to(torch.bfloat16))
        parts["prev"].append(draft_index(draft, ids[src]))
        parts["label"].append(_inside(draft, labels.cpu()))
        parts["soft_ids"].append(_inside(draft, feats.top_ids[src].cpu()))
        parts["soft_p"].append(feats.top_logp[src].cpu().float().exp())
        parts["w"].append(weights_k.expand(len(anchor), -1)[valid])


def _inside(draft, token_ids: torch.Tensor) -> torch.Tensor:
    """Target ids -> draft indices, -1 for ids outside the draft vocabulary."""
    idx = draft_index(draft, token_ids)
    return torch.where(idx < (draft.config.draft_vocab_size or draft.config.vocab_size), idx, -1)


def head_loss(draft, rows: torch.Tensor, batch: dict[str, torch.Tensor], distill_weight: float = 0.5) -> torch.Tensor:
    """The weighted loss of a batch of stored positions (see the module docstring); ``rows`` [V', H] float32."""
    states = batch["states"].float()
    logits = states @ rows.t() + draft.markov(batch["prev"], states)  # [n, V']
    logp = torch.log_softmax(logits, dim=-1)
    label, inside = batch["label"].clamp(min=0), batch["label"] >= 0
    hard = -logp.gather(1, label[:, None])[:, 0] * inside
    p = batch["soft_p"] * (batch["soft_ids"] >= 0)
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-12)
    soft = -(p * logp.gather(1, batch["soft_ids"].clamp(min=0))).sum(-1)
    row = (1 - distill_weight) * hard + distill_weight * soft
    return (batch["w"] * row).sum() / batch["w"].sum()


def block_spans(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(start row, length) of every stored block: the collector writes each block's positions in order, and block
    position 1 is the only one with weight exp(0) = 1."""
    starts = torch.nonzero(w == 1.0)[:, 0]
    return starts, torch.diff(starts, append=torch.tensor([len(w)]))


def _block_batch(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Row indices of the chosen blocks (in block order)."""
    offsets = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts, lengths) + torch.arange(int(lengths.sum())) - torch.repeat_interleave(
        offsets, lengths)


def train_head(draft, rows: torch.Tensor, data: dict[str, torch.Tensor], seconds: float, lr: float = 2e-3,
               batch_size: int = 2048, seed: int = 0, log=print, steps: int | None = None) -> dict:
    """AdamW on the head alone for ``seconds`` (cosine schedule over the steps the first 5 steps project) or for
    exactly ``steps`` (equal work for arms compared on a loaded machine). Batches are whole blocks in a seeded order
    (about ``batch_size`` positions each)."""
    params = [p for p in draft.markov.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    starts, lengths = block_spans(data["w"])
    n = len(data["w"])
    per_batch = max(1, round(len(starts) * min(batch_size, n) / n))  # blocks per batch
    g = torch.Generator().manual_seed(seed)
    order, at, step, total, history = torch.randperm(len(starts), generator=g), 0, 0, steps, []
    t0 = time.perf_counter()
    while total is None or step < total:
        if at + per_batch > len(starts):
            order, at = torch.randperm(len(starts), generator=g), 0
        pick = order[at: at + per_batch]
        at += per_batch
        idx = _block_batch(starts[pick], lengths[pick])
        factor = min(1.0, (step + 1) / 20) * (0.5 * (1 + math.cos(math.pi * step / total)) if total else 1.0)
        for group in opt.param_groups:
            group["lr"] = lr * max(factor, 0.05)
        loss = head_loss(draft, rows, {k: v[idx] for k, v in data.items()})
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        history.append(float(loss.detach()))
        if step == 5 and total is None:
            total = max(10, int(seconds / ((time.perf_counter() - t0) / 5)))
            log(f"train: {total} steps planned ({n} positions, {per_batch} blocks per batch)")
        if step % 100 == 0:
            log(f"train: step {step}/{total} loss {sum(history[-100:]) / 100:.4f}")
    first, last = history[:50], history[-50:]
    return {"steps": step, "seconds": time.perf_counter() - t0, "loss_first50": sum(first) / len(first),
            "loss_last50": sum(last) / len(last), "epochs": step * per_batch / len(starts)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dflash_core.training.markov_fit", description=__doc__.split("\n\n")[0])
    p.add_argument("--init", required=True, help="the drafter (with a draft vocabulary) whose head is trained")
    p.add_argument("--data", required=True, action="append", help="shard folder (repeatable)")
    p.add_argument("--out", required=True)
    p.add_argument("--rank", type=int, default=128)
    p.add_argument("--kind", choices=MARKOV_KINDS, default="gated")
    p.add_argument("--collect-minutes", type=float, default=9.0, help="time spent collecting positions")
    p.add_argument("--train-minutes", type=float, default=6.0, help="time spent training the head on them")
    p.add_argument("--positions", default=None,
                   help="a file of collected positions: read when it exists (no collection), else written")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--steps", type=int, default=None, help="train exactly this many steps (else --train-minutes)")
    p.add_argument("--batch", type=int, default=2048, help="positions per step (whole blocks, about this many)")
    p.add_argument("--anchors", type=int, default=48)
    p.add_argument("--max-len", type=int, default=768)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _ordered(data, max_len: int, seed: int) -> list[tuple[torch.Tensor, int]]:
    """The training sequences in a seeded random order, sorted by length inside windows of 64 (less padding)."""
    seqs = [(ids[:max_len], p) for ids, p in data.sequences if min(len(ids), max_len) - p >= 2]
    random.Random(seed).shuffle(seqs)
    return [s for lo in range(0, len(seqs), 64) for s in sorted(seqs[lo: lo + 64], key=lambda s: len(s[0]))]


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from .fit import load_training_data
    from ..loading import load_target

    target, tokenizer, _ = load_target("smollm2", torch.bfloat16, "cpu")
    draft = load_draft(a.init, dtype=torch.float32)
    if draft.draft_vocab is None:
        raise SystemExit("markov_fit trains a head over a draft vocabulary: --init a drafter that has one")
    if draft.markov is None:
        attach_markov_head(draft, a.rank, a.kind)
    positions = Path(a.positions) if a.positions else None
    t0 = time.perf_counter()
    if positions is not None and positions.is_file():
        stored = torch.load(positions)
        print(f"positions: {len(stored['w'])} read from {positions}", flush=True)
    else:
        seqs = _ordered(load_training_data(a.data, tokenizer, a.seed, 0), a.max_len, a.seed)
        t0 = time.perf_counter()
        stored = collect_positions(target, draft, seqs, t0 + a.collect_minutes * 60, a.anchors, seed=a.seed)
        n = int(stored["sequences"])
        stored["response_tokens"] = torch.tensor(sum(len(i) - p for i, p in seqs[:n]))
        stored["collect_seconds"] = torch.tensor(time.perf_counter() - t0)
        if positions is not None:
            save_atomic(stored, positions)
    print(f"collected {len(stored['w'])} positions from {int(stored['sequences'])} sequences "
          f"({int(stored['response_tokens'])} response tokens) in {float(stored['collect_seconds']) / 60:.1f} min",
          flush=True)
    rows = draft.head_rows(target.lm_head.weight).float()
    draft.train()
    data = {k: v for k, v in stored.items() if v.dim() > 0}
    stats = train_head(draft, rows, data, a.train_minutes * 60, a.lr, seed=a.seed, steps=a.steps,
                       batch_size=a.batch)
    draft.eval()
    out = Path(a.out)
    draft.save_pretrained(out / "drafter", dtype=torch.bfloat16)
    summary = {**stats, "collect_minutes": float(stored["collect_seconds"]) / 60, "positions": len(data["w"]),
               "sequences": int(stored["sequences"]), "response_tokens": int(stored["response_tokens"]),
               "options": vars(a)}
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "options"}), flush=True)


if __name__ == "__main__":
    main()
