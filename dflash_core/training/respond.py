"""The first recipe's training responses: the target answers the prompts with Hugging Face ``generate``.

Generated pairs are appended to ``samples.jsonl`` (one JSON object per prompt: source, prompt id, mode, prompt and
response token ids) batch by batch, so an interrupted run keeps what it finished and a rerun skips those prompts.
Used by ``python -m dflash_core.train`` (:mod:`.cli`); :mod:`.generate` is the faster path that also keeps the
target's features.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from .prompts import PromptItem

__all__ = ["GenerationConfig", "generate_responses", "load_samples"]


@dataclass(frozen=True)
class GenerationConfig:
    batch_size: int = 48
    max_new_tokens: int = 256
    max_prompt_tokens: int = 512
    sampled_fraction: float = 0.35  # share of batches decoded with sampling instead of greedy
    temperature: float = 0.7
    top_p: float = 0.95
    time_budget_s: float | None = None  # stop starting new batches after this much time
    seed: int = 0


def load_samples(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut off by an interruption: skipped, the later ones still count
                continue
    return out


def _end_with_newline(path: Path) -> None:
    """An interrupted run may leave a cut-off last line: end it, so the next appended sample starts a line."""
    if path.is_file() and path.stat().st_size:
        with open(path, "rb+") as f:
            f.seek(-1, 2)
            if f.read(1) != b"\n":
                f.write(b"\n")


def _batches(items: list[tuple[PromptItem, list[int]]], batch_size: int) -> Iterator[list]:
    """Batches of similar prompt length (sorted inside windows of 8 batches, to limit left padding)."""
    window = batch_size * 8
    for w in range(0, len(items), window):
        group = sorted(items[w:w + window], key=lambda x: len(x[1]))
        for b in range(0, len(group), batch_size):
            yield group[b:b + batch_size]


@torch.inference_mode()
def generate_responses(target, tokenizer, prompts: list[PromptItem], out_path: str | Path, config: GenerationConfig,
                       stop_ids: list[int], log=print, done: set[str] | None = None) -> int:
    """Append the target's responses to ``out_path`` (JSONL), skipping prompts already there (or in ``done``).

    Returns the number of new samples.
    """
    from ..data import build_chat

    out_path = Path(out_path)
    done = set(done or ()) | {s["prompt_id"] for s in load_samples(out_path)}
    todo = []
    for it in prompts:
        if it.prompt_id in done:
            continue
        ids = build_chat(tokenizer, [it.text])
        if len(ids) <= config.max_prompt_tokens:
            todo.append((it, ids))
    log(f"data: {len(done)} samples on disk, {len(todo)} prompts to go")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    device = target.device
    t0, written, n_tokens = time.perf_counter(), 0, 0
    from tqdm import tqdm

    bar = tqdm(total=len(todo), desc="generate", unit="prompt", mininterval=10)
    _end_with_newline(Path(out_path))
    with open(out_path, "a", encoding="utf-8") as f:
        for bi, batch in enumerate(_batches(todo, config.batch_size)):
            if config.time_budget_s is not None and time.perf_counter() - t0 > config.time_budget_s:
                log(f"data: time budget reached after {written} new samples")
                break
            width = max(len(ids) for _, ids in batch)
            input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
            attention = torch.zeros((len(batch), width), dtype=torch.long)
            for r, (_, ids) in enumerate(batch):  # left padding
                input_ids[r, width - len(ids):] = torch.tensor(ids)
                attention[r, width - len(ids):] = 1
            sampled = random.Random(f"mode:{config.seed}:{batch[0][0].prompt_id}").random() < config.sampled_fraction
            torch.manual_seed(config.seed * 1_000_003 + bi)
            kwargs = dict(do_sample=True, temperature=config.temperature, top_p=config.top_p, top_k=0) if sampled \
                else dict(do_sample=False)
            out = target.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                                  max_new_tokens=config.max_new_tokens, eos_token_id=stop_ids, pad_token_id=pad,
                                  **kwargs)
            new = out[:, width:].cpu()
            for r, (it, ids) in enumerate(batch):
                response = new[r].tolist()
                for k, tok in enumerate(response):
                    if tok in stop_ids:
                        response = response[:k + 1]
                        break
                n_tokens += len(response)
                f.write(json.dumps({"source": it.source, "prompt_id": it.prompt_id,
                                    "mode": "sampled" if sampled else "greedy",
                                    "prompt_ids": ids, "response_ids": response}) + "\n")
            f.flush()
            written += len(batch)
            bar.update(len(batch))
            elapsed = time.perf_counter() - t0
            log(f"data: batch {bi} ({'sampled' if sampled else 'greedy'}, {len(batch)} x <= {width}+"
                f"{new.shape[1]}): {written} samples, {n_tokens} response tokens, {n_tokens / elapsed:.0f} tok/s, "
                f"{elapsed / 60:.1f} min")
    bar.close()
    return written
