"""Train the embedded drafter from the teacher-forced stream and log tau against tokens seen:
``python -m experiments.studies.drafter_stream --out runs/stream --minutes 60``.

Starts from the shipped drafter (``--init``) and the committed training log (``--log``: the cursor that says which
corpus files and generated sequences earlier runs used, and the tau-vs-tokens curve), trains on the mix of sources
(:mod:`dflash_core.training.stream`), evaluates the fixed protocol (:mod:`experiments.studies.drafter_eval`, replayed:
DFlash chain and DDTree B=32, bf16 copy of the drafter as shipped) every ``--eval-every`` tokens, and writes into
``--out``:

* ``drafter/`` the trained drafter (bf16), ``checkpoint.pt`` (resumable: rerun the same command),
* ``training_log.json`` the input log plus this run (cursor after it, ``tokens_seen`` over all runs, throughput, the
  curve with cumulative tokens), ready to be committed next to the drafter when it replaces the shipped one,
* ``summary.json`` this run's numbers: tokens per source kind, target-pass and end-to-end tokens/s beside the
  machine's teacher-forced ceiling measured at the start, tau before and after.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import time
from pathlib import Path

import torch

from dflash_core.default import DEFAULT_DRAFT_DIR

ZOO = DEFAULT_DRAFT_DIR


def parse_mix(text: str) -> dict[str, float]:
    """``generated:0.3,code:0.35,math:0.35`` -> {kind: weight}."""
    mix = {}
    for part in text.split(","):
        kind, _, weight = part.partition(":")
        try:
            mix[kind.strip()] = float(weight)
        except ValueError:
            raise SystemExit(f"--mix: {part!r} is not kind:weight (e.g. generated:0.3,code:0.35,math:0.35)") from None
    return mix


def protocol_evaluator(target, tokenizer, stops, reference: Path, max_new_tokens: int = 128, budgets=("chain", 32)):
    """draft -> {"tau_chain", "tau_b32", per group ...}: the fixed protocol replayed on a bf16 copy of the drafter."""
    from experiments.studies.drafter_eval import protocol_prompts, reference_continuations, replay_rows

    prompts = protocol_prompts(tokenizer)
    refs = reference_continuations(target, prompts, max_new_tokens, stops, reference)
    dtype = next(target.parameters()).dtype

    def evaluate(draft) -> dict:
        shipped = copy.deepcopy(draft).to(dtype).eval()
        rows = replay_rows(target, ["d"], [shipped], list(budgets), prompts, refs, max_new_tokens, stops,
                           time.perf_counter(), quiet=True)
        out = {}
        for budget in budgets:
            name = "chain" if budget == "chain" else f"b{budget}"
            for group in ("math", "code", "chat", "all"):
                sel = [r for r in rows if r["budget"] == budget and (group == "all" or r["group"] == group)]
                tau = sum(r["tokens"] for r in sel) / max(1, sum(r["rounds"] for r in sel))
                out[f"tau_{name}" if group == "all" else f"tau_{name}_{group}"] = round(tau, 4)
        out["per_prompt"] = {f"{r['dataset']}/{r['sample_id']}/{r['budget']}": [r["tokens"], r["rounds"]]
                             for r in rows}
        return out

    return evaluate


def paired_change(before: dict, after: dict, budget: str) -> dict:
    """Per-prompt paired change of tau between two evaluations (their ``per_prompt`` tokens and rounds) for one
    budget (``chain`` or ``32``): mean, bootstrap 95% interval, prompts better / worse."""
    from experiments.bench.schema import bootstrap_ci

    keys = sorted(k for k in before["per_prompt"] if k.endswith(f"/{budget}") and k in after["per_prompt"])
    diffs = [after["per_prompt"][k][0] / after["per_prompt"][k][1] - before["per_prompt"][k][0] / before["per_prompt"][k][1]
             for k in keys]
    lo, hi = bootstrap_ci(diffs)
    return {"mean": sum(diffs) / max(1, len(diffs)), "ci95": [lo, hi], "prompts": len(diffs),
            "better": sum(d > 0 for d in diffs), "worse": sum(d < 0 for d in diffs)}


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (exactly one of ``--minutes`` and ``--tokens``)."""
    p = argparse.ArgumentParser(prog="python -m experiments.studies.drafter_stream",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--init", default=str(ZOO), help="drafter to start from (default: the shipped one)")
    p.add_argument("--log", default=str(ZOO / "training_log.json"),
                   help="training log to continue (cursor and curve); 'none' starts a fresh one")
    p.add_argument("--mix", default="generated:0.3,code:0.3,math:0.35,docs:0.05")
    p.add_argument("--generated-data", default=str(ZOO / "data"), help="token shards of the target's own answers")
    p.add_argument("--minutes", type=float, default=None, help="this run's training time (the schedule follows it)")
    p.add_argument("--tokens", type=int, default=None, help="or this run's response tokens")
    p.add_argument("--eval-every", type=int, default=500_000, help="tokens between fixed-protocol evaluations")
    p.add_argument("--seqs-per-step", type=int, default=8)
    p.add_argument("--anchors", type=int, default=48)
    p.add_argument("--max-len", type=int, default=768)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup-frac", type=float, default=0.04)
    p.add_argument("--distill-weight", type=float, default=0.5, help="soft-label weight for generated sequences")
    p.add_argument("--seed", type=int, default=0, help="corpus order seed (keep it across runs: the cursor counts in it)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="auto", help="auto (CUDA when available, else CPU), cpu, cuda, cuda:N")
    p.add_argument("--reference", default="runs/protocol-reference-bf16-128.json")
    a = p.parse_args(argv)
    if (a.minutes is None) == (a.tokens is None):
        p.error("give --minutes or --tokens")
    return a


def _prior_log(path: str, log) -> tuple[dict, dict]:
    """The training log this run continues (a fresh one for 'none' or a missing file) and the installed corpus's
    manifest; warns when the log's cursor counts in another corpus than the installed one."""
    from dflash_core.training.textcorpus import corpus_manifest

    prior = json.loads(Path(path).read_text()) if path != "none" and Path(path).is_file() else {"runs": [], "curve": []}
    manifest = corpus_manifest()
    if prior.get("corpus_fingerprint") not in (None, manifest["fingerprint"]):
        log(f"warning: the corpus differs from the one the log's cursor counts in ({prior['corpus_fingerprint']} vs "
            f"{manifest['fingerprint']}: other package versions); the cursor is used as is")
    return prior, manifest


def _generated_sequences(folder: str, tokenizer, log) -> list[tuple[str, torch.Tensor, int]]:
    """[(key, ids, prompt length)] of the token shards of the target's own answers in ``folder``."""
    from dflash_core.training.corpus import load_corpus

    corpus = load_corpus(folder, tokenizer)
    generated = [(k, ids, pl) for k, (ids, pl) in zip(corpus.keys, corpus.sequences)]
    log(f"generated: {len(generated)} sequences, {corpus.response_tokens} response tokens ({corpus.skipped} skipped)")
    return generated


def _run_record(a, run_id: str, mix: dict, state, evals: list[dict], ceiling: float, dropped: int) -> dict:
    """This run's entry of the training log: setup, tokens, throughput, tau at start and end, and with two or more
    evaluations the paired change of tau against the drafter it started from."""
    from dflash_core.timing import cpu_model

    run = {"run": run_id, "date": datetime.date.today().isoformat(), "cpu": cpu_model(), "dtype": "bfloat16",
           "threads": torch.get_num_threads(), "init": a.init, "mix": mix, "steps": state.step,
           "tokens": state.tokens, "tokens_by_kind": state.by_kind, "train_minutes": state.train_seconds / 60,
           "ceiling_tokens_per_s": ceiling, "target_pass_tokens_per_s": state.target_tokens / state.target_seconds,
           "end_to_end_response_tokens_per_s": state.tokens / state.train_seconds,
           "tau_start": {k: evals[0][k] for k in ("tau_chain", "tau_b32")} if evals else None,
           "tau_end": {k: evals[-1][k] for k in ("tau_chain", "tau_b32")} if evals else None,
           "corpus_dropped_items": dropped}
    if len(evals) >= 2:  # paired per prompt, the run's drafter against the one it started from
        run["tau_change"] = {b: paired_change(evals[0], evals[-1], b) for b in ("chain", "32")}
        # not worse: the mean paired change is >= 0 for both the chain and the B=32 tree
        run["not_worse_than_init"] = all(c["mean"] >= 0 for c in run["tau_change"].values())
    return run


def _extended_log(prior: dict, manifest: dict, run: dict, state, evals: list[dict]) -> dict:
    """The input training log plus this run: its entry, the cursor after it, tokens seen over all runs and the curve
    with cumulative tokens."""
    base = prior.get("tokens_seen", 0)  # response tokens the drafter had trained on before this run, all runs
    curve = prior.get("curve", []) + [{"run": run["run"], "tokens": base + h["tokens"], "tau_chain": h["tau_chain"],
                                       "tau_b32": h["tau_b32"]} for h in evals]
    return {**prior, "corpus_fingerprint": manifest["fingerprint"], "corpus": manifest["sources"],
            "cursor": vars(state.cursor), "tokens_seen": base + state.tokens, "runs": prior["runs"] + [run],
            "curve": curve}


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from dflash_core import load_draft
    from dflash_core.loading import load_target
    from dflash_core.timing import cpu_model
    from dflash_core.training.train_config import TrainConfig
    from dflash_core.training.responses import teacher_forced_ceiling
    from dflash_core.training.loop import setup_logging
    from dflash_core.training.stream import Cursor, SequenceStream, StreamState, stream_train

    from experiments.bench.schema import write_json_atomic

    out = Path(a.out)
    log = setup_logging(out).info
    log(f"options: {json.dumps(vars(a), sort_keys=True)}")
    mix = parse_mix(a.mix)
    target, tokenizer, stops = load_target("default", torch.bfloat16, a.device)  # the drafter trains on its device
    prior, manifest = _prior_log(a.log, log)
    cursor = Cursor(**prior.get("cursor", {}))
    draft = load_draft(a.init, dtype=torch.float32)
    generated = _generated_sequences(a.generated_data, tokenizer, log) if mix.get("generated", 0) > 0 else []
    ceiling = teacher_forced_ceiling(target, 8, 320)
    log(f"teacher-forced ceiling: {ceiling:.0f} tokens/s ([8, 320], {torch.get_num_threads()} threads, {cpu_model()})")
    stream = SequenceStream(tokenizer, mix, cursor, a.seqs_per_step, a.max_len, stops[:1], generated, seed=a.seed)
    cfg = TrainConfig(anchors=a.anchors, seqs_per_step=a.seqs_per_step, lr=a.lr, warmup_frac=a.warmup_frac,
                      max_len=a.max_len, distill_weight=a.distill_weight, loss_vocab="draft", seed=a.seed,
                      ckpt_every=50)
    evaluate = protocol_evaluator(target, tokenizer, stops, Path(a.reference))
    t0 = time.perf_counter()
    state = stream_train(target, draft, stream, cfg, out, log, evaluate, minutes=a.minutes, tokens=a.tokens,
                         eval_every_tokens=a.eval_every, state=StreamState(cursor=cursor))
    draft.save_pretrained(out / "drafter", dtype=torch.bfloat16)
    evals = [h for h in state.history if "tau_chain" in h]
    run = _run_record(a, out.name, mix, state, evals, ceiling, stream.stats["dropped"])
    write_json_atomic(out / "training_log.json", _extended_log(prior, manifest, run, state, evals))
    summary = {**run, "history": state.history, "total_minutes": (time.perf_counter() - t0) / 60}
    write_json_atomic(out / "summary.json", summary)
    log(f"done: {state.step} steps, {state.tokens} tokens, tau {run['tau_start']} -> {run['tau_end']}; "
        f"target pass {run['target_pass_tokens_per_s']:.0f} tok/s vs ceiling {ceiling:.0f} "
        f"({run['target_pass_tokens_per_s'] / ceiling:.0%})")


if __name__ == "__main__":
    main()
