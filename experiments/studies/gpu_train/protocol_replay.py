"""The protocol on the GPU: the target's greedy continuations once, then each drafter's rounds replayed on them.

``references`` runs plain greedy decoding of the packed protocol prompts on the device (the text every drafter is
scored on: on a GPU it can differ from a CPU's at bf16 near-ties, so the drafters are compared on this text, not
against numbers measured elsewhere). ``replay`` scores one drafter per process, so several run side by side:
``python -m experiments.studies.gpu_train.protocol_replay replay --draft DIR --label l3 ...``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dflash_core.files import write_text_atomic

from .pack import load_protocol

__all__ = ["references", "replay", "main"]

BUDGETS = ("chain", 8, 32)


def references(target, pack: str | Path, out: Path, max_new_tokens: int = 128, limit: int | None = None) -> dict:
    """{dataset/sample_id: greedy continuation} of the protocol prompts, written to ``out`` (JSON)."""
    from dflash_core import autoregressive_generate

    prompts, stops = load_protocol(pack)
    refs = {}
    for _, name, sid, ids in prompts[:limit]:
        device = target.lm_head.weight.device
        res = autoregressive_generate(target, torch.tensor([ids], device=device), max_new_tokens,
                                      stop_token_ids=stops)
        refs[f"{name}/{sid}"] = res.new_token_ids
    write_text_atomic(out, json.dumps({"max_new_tokens": max_new_tokens, "continuations": refs}) + "\n")
    return refs


def replay(target, draft, label: str, pack: str | Path, refs_path: Path, budgets=BUDGETS) -> list[dict]:
    """Rows {group, dataset, sample_id, draft, budget, rounds, tokens} of every protocol prompt with a reference."""
    from experiments.studies.drafter_eval import replay_rows

    prompts, stops = load_protocol(pack)
    blob = json.loads(refs_path.read_text())
    refs = blob["continuations"]
    prompts = [p for p in prompts if f"{p[1]}/{p[2]}" in refs]
    return replay_rows(target, [label], [draft], list(budgets), prompts, refs, blob["max_new_tokens"], stops,
                       time.perf_counter(), quiet=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.studies.gpu_train.protocol_replay")
    p.add_argument("what", choices=["references", "replay"])
    p.add_argument("--pack", required=True)
    p.add_argument("--refs", required=True, help="the continuations' JSON (written by 'references')")
    p.add_argument("--draft", help="drafter folder ('replay')")
    p.add_argument("--label")
    p.add_argument("--out", help="rows JSON ('replay')")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts (smoke runs)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    from dflash_core.model import load_draft
    from dflash_core.training.targets import resolve_device

    a = parse_args(argv)
    device = resolve_device(a.device)
    from .worker import _target

    target = _target(a.target, device)
    t0 = time.perf_counter()
    if a.what == "references":
        refs = references(target, a.pack, Path(a.refs), a.max_new_tokens, a.limit)
        print(f"references: {len(refs)} prompts in {time.perf_counter() - t0:.1f} s", flush=True)
        return
    if not (a.draft and a.label and a.out):
        raise SystemExit("replay needs --draft, --label and --out")
    draft = load_draft(a.draft, device=device, dtype=target.dtype)
    rows = replay(target, draft, a.label, a.pack, Path(a.refs))
    write_text_atomic(Path(a.out), json.dumps({"label": a.label, "draft": a.draft, "rows": rows,
                                               "seconds": time.perf_counter() - t0}) + "\n")
    print(f"replay {a.label}: {len(rows)} rows in {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
