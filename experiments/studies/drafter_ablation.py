"""Drafter recipe ablations on the fixed protocol: ``python -m experiments.studies.drafter_ablation --data runs/data
--out DIR``.

Every configuration trains a drafter from random weights on the same data shards for the same number of optimizer
steps (``--steps``), then the fixed evaluation protocol (:mod:`experiments.studies.drafter_eval`: 24 held-out benchmark
prompts, greedy, 128 new tokens) is replayed offline for the chain and a DDTree budget of 32. One configuration
differs from ``base`` in one setting. Data are loaded once for all configurations. Resumable: a configuration whose
``result.json`` exists is not run again, and an interrupted one continues from its checkpoint. Writes
``ablation.json`` and ``ablation.md`` (the table) after every configuration.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

# one setting changed from BASE per entry (fit.py option names)
BASE = dict(layers=2, taps=5, draft_vocab=4096, loss_vocab="draft", distill_weight=0.5, lr=6e-4, anchors=48,
            gamma=7.0)
ABLATIONS: dict[str, dict] = {
    "base": {},
    "sampled-softmax": dict(draft_vocab=0, loss_vocab="batch"),
    "full-softmax": dict(draft_vocab=0, loss_vocab="full"),
    "draft-vocab-16k": dict(draft_vocab=16384),
    "hard-labels": dict(distill_weight=0.0),
    "distill-only": dict(distill_weight=1.0),
    "lr-1.2e-3": dict(lr=1.2e-3),
    "lr-3e-4": dict(lr=3e-4),
    "anchors-96": dict(anchors=96),
    "anchors-24": dict(anchors=24),
    "layers-1": dict(layers=1),
    "layers-3": dict(layers=3),
    "taps-3": dict(taps=3),
    "gamma-4": dict(gamma=4.0),
    "gamma-12": dict(gamma=12.0),
}


def _table(results: dict[str, dict]) -> str:
    lines = ["| configuration | changed | steps | train min | loss (last 50) | tau chain | tau B=32 |",
             "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        changed = ", ".join(f"{k}={v}" for k, v in ABLATIONS.get(name, {}).items()) or "-"
        lines.append(f"| {name} | {changed} | {r['steps']} | {r['train_minutes']:.1f} | {r['loss_last50']:.3f} | "
                     f"{r['tau']['chain']:.3f} | {r['tau']['32']:.3f} |")
    return "\n".join(lines) + "\n"


def _config_names(configs: str) -> list[str]:
    """The configuration names of a comma-separated ``--configs`` value (empty entries dropped)."""
    return [n for n in configs.split(",") if n]


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (every name in ``--configs`` must be one of ``ABLATIONS``)."""
    p = argparse.ArgumentParser(prog="python -m experiments.studies.drafter_ablation",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, action="append", help="shard folder (repeatable)")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per configuration (the same for all)")
    p.add_argument("--configs", default=",".join(ABLATIONS), help=f"comma-separated subset of {list(ABLATIONS)}")
    p.add_argument("--seqs-per-step", type=int, default=8)
    p.add_argument("--max-len", type=int, default=768)
    p.add_argument("--reference", default=None, help="cache of the protocol's greedy continuations")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="auto", help="auto (CUDA when available, else CPU), cpu, cuda, cuda:N")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    unknown = [n for n in _config_names(a.configs) if n not in ABLATIONS]
    if unknown:
        p.error(f"unknown configuration(s) {unknown}: choose from {list(ABLATIONS)}")
    return a


def _new_drafter(opt: dict, target, data, stops):
    """A drafter from random weights (seeded by the caller) with the configuration's shape and draft vocabulary."""
    from dflash_core.model import DFlashDraftModel
    from dflash_core.training.train_config import DraftSpec, make_draft_config
    from dflash_core.training.corpus import build_draft_vocab

    spec = DraftSpec(layers=opt["layers"], taps=opt["taps"], block_size=16, mask_token_id=16)
    draft = DFlashDraftModel(make_draft_config(target.config, spec))
    if opt["draft_vocab"]:
        draft.set_draft_vocab(build_draft_vocab(data.responses, opt["draft_vocab"], always=stops))
    return draft


def _replayed_tau(target, name: str, draft, prompts, refs, stops) -> dict[str, float]:
    """{"chain", "32"}: tau of the fixed protocol, replayed offline, for the chain and a DDTree budget of 32."""
    from experiments.studies.drafter_eval import replay_rows

    t0 = time.perf_counter()
    rows = replay_rows(target, [name], [draft], ["chain", 32], prompts, refs, 128, stops, t0)
    tau = {}
    for budget in ("chain", 32):
        mine = [r for r in rows if r["budget"] == budget]
        tau[str(budget)] = sum(r["tokens"] for r in mine) / max(1, sum(r["rounds"] for r in mine))
    return tau


def _run_config(name: str, a, target, data, prompts, refs, stops, out: Path, log) -> dict:
    """Train configuration ``name`` in ``out/name`` (resumable), save its drafter, replay the protocol and write its
    ``result.json``. Returns the result."""
    from dflash_core.training.train_config import TrainConfig
    from dflash_core.training.loop import train

    from experiments.bench.schema import write_json_atomic

    folder = out / name
    opt = {**BASE, **ABLATIONS[name]}
    log(f"=== {name}: {opt}")
    torch.manual_seed(a.seed)
    draft = _new_drafter(opt, target, data, stops)
    cfg = TrainConfig(gamma=opt["gamma"], anchors=opt["anchors"], seqs_per_step=a.seqs_per_step, lr=opt["lr"],
                      steps=a.steps, max_len=a.max_len, distill_weight=opt["distill_weight"], distill_topk=8,
                      loss_vocab=opt["loss_vocab"], eval_every=10 ** 9, seed=a.seed,
                      cache_features=not data.has_features)
    data.layer_ids = list(draft.config.target_layer_ids)
    state = train(target, draft, data.sequences, cfg, folder, log, feature_source=data.feature_source)
    draft = draft.to(torch.bfloat16).eval()
    draft.save_pretrained(folder / "drafter", dtype=torch.bfloat16)
    tau = _replayed_tau(target, name, draft, prompts, refs, stops)
    tail = state.history[-50:]
    result = {"options": opt, "steps": state.step, "train_minutes": state.train_seconds / 60,
              "loss_last50": sum(h["loss"] for h in tail) / max(1, len(tail)),
              "acc1_last50": sum(h["acc1"] for h in tail) / max(1, len(tail)), "tau": tau,
              "response_tokens": data.response_tokens, "sequences": len(data.sequences)}
    write_json_atomic(folder / "result.json", result)
    log(f"=== {name}: tau chain {tau['chain']:.3f}, B=32 {tau['32']:.3f}, loss {result['loss_last50']:.3f}, "
        f"{result['train_minutes']:.1f} min")
    return result


def _write_summary(out: Path, results: dict[str, dict], steps: int) -> None:
    """Write ``ablation.json`` (every result so far, with the setup) and ``ablation.md`` (the table)."""
    from dflash_core.timing import cpu_model

    from experiments.bench.schema import write_json_atomic, write_text_atomic

    protocol = "experiments.studies.drafter_eval, replayed, greedy, 128 tokens"
    write_json_atomic(out / "ablation.json", {"results": results, "steps": steps, "cpu": cpu_model(),
                                              "threads": torch.get_num_threads(), "base": BASE, "protocol": protocol})
    write_text_atomic(out / "ablation.md", _table(results))


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from dflash_core.loading import load_target
    from dflash_core.training.fit import load_training_data
    from dflash_core.training.loop import setup_logging

    from experiments.studies.drafter_eval import protocol_prompts, reference_continuations

    out = Path(a.out)
    log = setup_logging(out).info
    target, tokenizer, stops = load_target("default", torch.bfloat16, a.device)  # the drafter trains on its device
    data = load_training_data(a.data, tokenizer, a.seed, eval_prompts=0, log=log)
    prompts = protocol_prompts(tokenizer)
    refs = reference_continuations(target, prompts, 128, stops,
                                   Path(a.reference or out / "protocol-reference-bfloat16-128.json"))
    summary_path = out / "ablation.json"
    results = json.loads(summary_path.read_text())["results"] if summary_path.exists() else {}
    for name in _config_names(a.configs):
        if (out / name / "result.json").exists():
            results[name] = json.loads((out / name / "result.json").read_text())
            continue
        results[name] = _run_config(name, a, target, data, prompts, refs, stops, out, log)
        _write_summary(out, results, a.steps)
    print(_table(results))


if __name__ == "__main__":
    main()
