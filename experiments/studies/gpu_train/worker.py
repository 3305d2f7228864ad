"""Train one arm for a wall-clock budget: ``python -m experiments.studies.gpu_train.worker --arm l3 ...``.

Joint training of every weight (layers, projection, Markov head) from the initial drafter, over the packed sequences,
with the shipped recipe's loss (half hard label, half the target's top-8 distribution, position decay 7) over the
drafter's own vocabulary. The GPU changes two things: every response position is an anchor (``--anchors`` caps them;
the published recipe's 512 per 3,072-token sequence), and the target features come from a teacher-forced pass per
sequence at each use (not cached: several arms share one GPU). Writes ``drafter/`` (bf16) and ``summary.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dflash_core.files import write_text_atomic

from .arms import ARMS, apply_arm
from .pack import load_sequences

__all__ = ["main"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.studies.gpu_train.worker",
                                description=__doc__.split("\n")[0])
    p.add_argument("--arm", choices=sorted(ARMS), required=True)
    p.add_argument("--pack", required=True, help="folder with train.npz (experiments.studies.gpu_train pack)")
    p.add_argument("--init", required=True, help="the drafter every arm starts from")
    p.add_argument("--out", required=True)
    p.add_argument("--minutes", type=float, default=None,
                   help="training wall-clock budget (the lr schedule follows it)")
    p.add_argument("--until", type=float, default=None,
                   help="instead of --minutes: train until this Unix time less --save-margin seconds, however long "
                        "the setup took (an orchestrator with a hard deadline passes it)")
    p.add_argument("--save-margin", type=float, default=10.0)
    p.add_argument("--device", default="auto")
    p.add_argument("--seqs-per-step", type=int, default=16)
    p.add_argument("--anchors", type=int, default=256)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", default="smollm2",
                   help="'smollm2', or for smoke runs a random target: 'smollm2-random' (its shape) or 'tiny'")
    p.add_argument("--per-sequence", action="store_true",
                   help="one target pass and drafter forward per sequence (default: one padded batch per step)")
    p.add_argument("--snapshot-at", type=float, default=0.5,
                   help="also save the drafter once this fraction of the training time has passed (drafter-half/)")
    return p.parse_args(argv)


def _target(name: str, device: torch.device):
    from dflash_core.loading import load_target

    if name == "tiny":
        from experiments.bench.models import tiny_target

        return tiny_target().to(device=device, dtype=torch.bfloat16)
    if name == "smollm2-random":  # the embedded target's shape with random weights (speed and code paths only)
        from experiments.studies.gpu_run.steps import smollm2_shaped_pair

        return smollm2_shaped_pair(torch.bfloat16, device)[0]
    target, _, _ = load_target(name, torch.bfloat16, device)
    return target


def _snapshot(folder: Path, after_s: float, log):
    """The training loop's ``evaluate`` hook, used to save the drafter once, the first time it is called after
    ``after_s`` seconds (it scores nothing: the protocol replay scores the saved drafters afterwards)."""
    start, saved = time.perf_counter(), []

    def hook(draft) -> dict:
        if not saved and time.perf_counter() - start >= after_s:
            draft.save_pretrained(folder, dtype=torch.bfloat16)
            saved.append(True)
            log(f"snapshot saved to {folder} after {time.perf_counter() - start:.0f} s")
        return {}

    return hook


def main(argv=None) -> dict:
    from dflash_core.model import load_draft
    from dflash_core.training.loop import setup_logging, train
    from dflash_core.training.targets import resolve_device
    from dflash_core.training.train_config import TrainConfig

    a = parse_args(argv)
    out = Path(a.out)
    log = setup_logging(out).info
    log(f"options: {json.dumps(vars(a), sort_keys=True)}")
    t0 = time.perf_counter()
    device = resolve_device(a.device)
    target = _target(a.target, device)
    sequences, ranked = load_sequences(a.pack)
    draft = apply_arm(load_draft(a.init, dtype=torch.float32), ARMS[a.arm], ranked)
    log(f"arm {a.arm}: {len(draft.layers)} layers, draft vocabulary {draft.config.draft_vocab_size}, "
        f"{sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M parameters, {len(sequences)} sequences, "
        f"setup {time.perf_counter() - t0:.1f} s")
    if (a.minutes is None) == (a.until is None):
        raise SystemExit("give exactly one of --minutes and --until")
    budget_s = a.minutes * 60 if a.minutes is not None else a.until - a.save_margin - time.time()
    if budget_s <= 0:
        raise SystemExit(f"no training time left ({budget_s:.0f} s) after a setup of {time.perf_counter() - t0:.0f} s")
    cfg = TrainConfig(anchors=a.anchors, seqs_per_step=a.seqs_per_step, lr=a.lr, max_len=a.max_len,
                      loss_vocab="draft" if draft.draft_vocab is not None else "full",
                      cache_features=False, time_budget_s=budget_s, eval_every=25, ckpt_every=10**9,
                      seed=a.seed, batched=not a.per_sequence)
    state = train(target, draft, sequences, cfg, None, log, evaluate=_snapshot(out / "drafter-half",
                                                                               budget_s * a.snapshot_at, log))
    draft.save_pretrained(out / "drafter", dtype=torch.bfloat16)
    mean_response = sum(len(s) - p for s, p in sequences) / max(1, len(sequences))
    tail = state.history[-50:]
    summary = {"arm": a.arm, "layers": len(draft.layers), "draft_vocab": draft.config.draft_vocab_size,
               "steps": state.step, "train_minutes": state.train_seconds / 60,
               "sequences_seen": state.step * a.seqs_per_step,
               "response_tokens_seen_est": round(state.step * a.seqs_per_step * mean_response),
               "loss_first50": sum(h["loss"] for h in state.history[:50]) / max(1, min(50, len(state.history))),
               "loss_last50": sum(h["loss"] for h in tail) / max(1, len(tail)),
               "acc1_last50": sum(h["acc1"] for h in tail) / max(1, len(tail)),
               "options": vars(a), "device": str(device),
               "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
               "history": [{k: h[k] for k in ("step", "loss", "acc1")} for h in state.history if h["step"] % 25 == 0]}
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    log(f"done: {state.step} steps in {state.train_seconds / 60:.2f} min, loss {summary['loss_last50']:.4f}")
    return summary


if __name__ == "__main__":
    main()
