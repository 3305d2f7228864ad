"""The drafter's fixed evaluation protocol:
``python -m experiments.studies.drafter_eval --draft <folder> [--draft ...]``.

24 prompts of the benchmark selection that no training run may use (``select_items(name, n, seed=0)``): 8 math
(4 GSM8K, 4 MATH-500), 8 code (HumanEval), 8 chat (MT-Bench first turns). Greedy, 128 new tokens. For every drafter
given: DFlash chain tau and DDTree B=32 tau (tau counts the bonus token; mean committed tokens per round over all
rounds of a group), per group and overall, plus decode seconds. ``--check-ar`` also runs plain decoding and counts the
outputs that equal it exactly (do this in fp32: bf16 multi-token and one-token forwards round differently).
Drafters are evaluated interleaved per prompt, so machine noise hits them alike. Writes JSON with ``--out``.

``--replay`` evaluates without running the decode loop: the target's greedy continuations are computed once (cached
in ``--reference``) and every drafter's rounds are replayed from one batched drafter pass per prompt
(:mod:`dflash_core.replay`; exact in fp32, within bf16 rounding otherwise). Seconds per drafter instead of minutes:
the mode for ablations. It reports tau only (no timings).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

PROTOCOL = (("gsm8k", 4, "math"), ("math500", 4, "math"), ("humaneval", 8, "code"), ("mt-bench", 8, "chat"))


def protocol_prompts(tokenizer) -> list[tuple[str, str, str, list[int]]]:
    """[(group, dataset, sample_id, prompt ids)] of the fixed protocol."""
    from dflash_core.training.pools.catalog import build_chat, select_items

    out = []
    for name, n, group in PROTOCOL:
        for item in select_items(name, n, seed=0):
            out.append((group, name, item.sample_id, build_chat(tokenizer, item.turns[:1])))
    return out


def reference_continuations(target, prompts, max_new_tokens: int, stops, path: Path, temperature: float = 0.0,
                            seed: int = 0) -> dict[str, list[int]]:
    """{dataset/sample_id: the target's continuation}, cached in ``path`` per target fingerprint: greedy, or at
    ``temperature`` > 0 sampled by plain decoding with ``seed`` (replaying a sampled continuation gives the rounds
    of sample-and-match decoding under the coupling in which the target draws exactly these tokens)."""
    import json

    from dflash_core import autoregressive_generate
    from dflash_core.training.shards import target_fingerprint

    from experiments.bench.schema import write_json_atomic

    key = target_fingerprint(target) + f"/{next(target.parameters()).dtype}/{max_new_tokens}/{sorted(stops)}"
    if temperature > 0:
        key += f"/T={temperature}/seed={seed}"
    cached = json.loads(path.read_text()) if path.exists() else {}
    if cached.get("key") != key:
        cached = {"key": key, "continuations": {}}
    refs = cached["continuations"]
    missing = [(name, sid, ids) for _, name, sid, ids in prompts if f"{name}/{sid}" not in refs]
    for name, sid, ids in missing:
        refs[f"{name}/{sid}"] = autoregressive_generate(target, torch.tensor([ids]), max_new_tokens, temperature,
                                                        stop_token_ids=stops, seed=seed).new_token_ids
    if missing:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, cached)
    return refs


SPEC_WORDS = ("chain", "auto", "chain-auto")


def parse_spec(text: str):
    """One ``--budgets`` item: ``chain``, ``auto``, ``chain-auto``, a node budget, or any of them after ``lookup-``
    (DDTree with prompt-lookup branches)."""
    body = text.removeprefix("lookup-")
    if body not in SPEC_WORDS and not body.isdigit():
        raise SystemExit(f"--budgets: {text!r} is not chain, auto, chain-auto or a node budget (optionally after "
                         "'lookup-')")
    return int(text) if text.isdigit() else text


def _spec_policy(spec, target, draft):
    """The policy replay runs for one ``--budgets`` item."""
    from ddtree.generate import make_policy

    text = str(spec)
    if not text.startswith("lookup-"):
        return make_policy(spec, target, draft)
    from ddtree import LookupTreePolicy

    body = parse_spec(text.removeprefix("lookup-"))
    return LookupTreePolicy(make_policy(body, target, draft) if body == "auto" else body)


def replay_rows(target, labels, drafts, budgets, prompts, refs, max_new_tokens: int, stops, t0: float,
                quiet: bool = False) -> list[dict]:
    """Rows like the decode loop's (rounds and tokens per prompt, drafter and budget) from offline replay."""
    from dflash_core.replay import replay_policies

    rows = []
    for group, name, sid, ids in prompts:
        full = torch.tensor(ids + refs[f"{name}/{sid}"])
        for label, draft in zip(labels, drafts):
            policies = {str(b): _spec_policy(b, target, draft) for b in budgets}
            got = replay_policies(target, draft, policies, full, len(ids), max_new_tokens, stops)
            for budget in budgets:
                res = got[str(budget)]
                rows.append({"group": group, "dataset": name, "sample_id": sid, "draft": label, "budget": budget,
                             "rounds": len(res.acceptance_lengths), "tokens": sum(res.acceptance_lengths)})
        if not quiet:
            print(f"[{time.perf_counter() - t0:.0f}s] {group}/{name}/{sid} replayed", flush=True)
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (``--check-ar`` and ``--replay`` exclude each other)."""
    p = argparse.ArgumentParser(prog="python -m experiments.studies.drafter_eval",
                                description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--draft", action="append", required=True, help="drafter folder (repeatable)")
    p.add_argument("--label", action="append", help="a name per --draft (default: the folder)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: the machine's (bf16 if native)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--budgets", default="chain,32", help="comma-separated: chain, auto, chain-auto, node budgets; "
                   "'lookup-auto' or 'lookup-32' add prompt-lookup branches")
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts (smoke runs)")
    p.add_argument("--check-ar", action="store_true")
    p.add_argument("--bigram", type=float, default=None,
                   help="also evaluate the first drafter with a count-based bigram of the committed training "
                        "answers as its Markov head, at this weight (a baseline for learned heads)")
    p.add_argument("--replay", action="store_true", help="replay rounds offline from cached greedy continuations")
    p.add_argument("--reference", default=None,
                   help="--replay: cache of the greedy continuations (default runs/protocol-reference-DTYPE-N.json)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="auto", help="auto (CUDA when available, else CPU), cpu, cuda, cuda:N")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.replay and a.check_ar:
        p.error("--check-ar compares decode-loop outputs with plain decoding; --replay has none (drop one)")
    return a


def _load_drafters(a, dtype) -> tuple[list[str], list]:
    """(labels, drafters): every ``--draft`` with its ``--label`` (default: the folder's name)."""
    from dflash_core import load_draft

    labels = list(a.label or [Path(d).name for d in a.draft])
    return labels, [load_draft(d, device=a.device_resolved, dtype=dtype) for d in a.draft]


def _bigram_drafter(a, dtype, tokenizer):
    """The first drafter with :func:`dflash_core.model.bigram_head` over the committed training answers."""
    from dflash_core import load_draft
    from dflash_core.default import DEFAULT_DRAFT_DIR
    from dflash_core.model import bigram_head
    from dflash_core.training.fit import load_training_data

    draft = load_draft(a.draft[0], device=a.device_resolved, dtype=dtype)
    data = load_training_data([DEFAULT_DRAFT_DIR / "data"], tokenizer, eval_prompts=0, log=lambda *_: None)
    draft.markov = bigram_head(draft, data.responses, a.bigram).to(a.device_resolved, torch.float32)
    return draft


def _decode_rows(target, labels, drafts, budgets, prompts, max_new_tokens: int, stops, check_ar: bool,
                 t0: float) -> list[dict]:
    """Rows (rounds, tokens and timings per prompt, drafter and budget) from the decode loop, drafters interleaved
    per prompt; with ``check_ar`` whether each output equals plain decoding."""
    from dflash_core import autoregressive_generate
    from ddtree import ddtree_generate

    rows = []
    for group, name, sid, ids in prompts:
        x = torch.tensor([ids])
        ref = None
        if check_ar:
            ref = autoregressive_generate(target, x, max_new_tokens, stop_token_ids=stops).new_token_ids
        for label, draft in zip(labels, drafts):
            for budget in budgets:
                res = ddtree_generate(target, draft, x, budget=parse_spec(str(budget).removeprefix("lookup-")),
                                      lookup=str(budget).startswith("lookup-"), max_new_tokens=max_new_tokens,
                                      stop_token_ids=stops)
                rows.append({"group": group, "dataset": name, "sample_id": sid, "draft": label, "budget": budget,
                             "rounds": len(res.acceptance_lengths), "tokens": sum(res.acceptance_lengths),
                             "decode_s": res.timings.get("decode"), "draft_s": res.timings.get("draft"),
                             "verify_s": res.timings.get("verify"),
                             "matches_ar": None if ref is None else res.new_token_ids == ref})
        print(f"[{time.perf_counter() - t0:.0f}s] {group}/{name}/{sid} done", flush=True)
    return rows


def _summarise(rows: list[dict], labels, budgets, replay: bool, check_ar: bool) -> dict:
    """{"<label> <budget>": tau per group and overall, plus (decode loop) draft ms per round and decode seconds and
    (``check_ar``) the outputs equal to plain decoding}."""
    summary = {}
    for label in labels:
        for budget in budgets:
            key = f"{label} {budget}"
            mine = [r for r in rows if r["draft"] == label and r["budget"] == budget]
            entry = {}
            for group in ("math", "code", "chat", "all"):
                sel = [r for r in mine if group == "all" or r["group"] == group]
                entry[group] = sum(r["tokens"] for r in sel) / max(1, sum(r["rounds"] for r in sel))
            rounds = max(1, sum(r["rounds"] for r in mine))
            if not replay:
                entry["draft_ms_per_round"] = 1000 * sum(r["draft_s"] or 0 for r in mine) / rounds
                entry["decode_s"] = sum(r["decode_s"] or 0 for r in mine)
            if check_ar:
                entry["matches_ar"] = f"{sum(bool(r['matches_ar']) for r in mine)}/{len(mine)}"
            if label != labels[0]:
                entry["paired_vs_" + labels[0]] = paired_change(rows, labels[0], label, budget)
            summary[key] = entry
    return summary


def paired_change(rows: list[dict], base: str, label: str, budget) -> str:
    """Per-prompt tau of ``label`` minus ``base`` at ``budget``: mean and bootstrap 95% interval, as text."""
    from experiments.bench.schema import bootstrap_ci

    tau = {(r["draft"], r["dataset"], r["sample_id"]): r["tokens"] / max(1, r["rounds"])
           for r in rows if r["budget"] == budget}
    diffs = [tau[(label, d, s)] - t for (who, d, s), t in tau.items() if who == base and (label, d, s) in tau]
    lo, hi = bootstrap_ci(diffs)
    return "n/a" if lo is None else f"{sum(diffs) / len(diffs):+.3f} [{lo:+.3f}, {hi:+.3f}]"


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from dflash_core.default import resolve_device
    from dflash_core.loading import load_target

    from experiments.bench.models import resolve_dtype

    a.device_resolved = resolve_device(a.device)
    dtype = resolve_dtype(a.dtype or "auto", a.device_resolved)
    target, tokenizer, stops = load_target("default", dtype, a.device_resolved)
    labels, drafts = _load_drafters(a, dtype)
    if a.bigram is not None:
        labels.append(f"{labels[0]}+bigram{a.bigram:g}")
        drafts.append(_bigram_drafter(a, dtype, tokenizer))
    budgets = [parse_spec(b) for b in a.budgets.split(",")]
    prompts = protocol_prompts(tokenizer)[: a.limit]
    t0 = time.perf_counter()
    if a.replay:
        ref_path = Path(a.reference or f"runs/protocol-reference-{str(dtype).split('.')[-1]}-{a.max_new_tokens}.json")
        refs = reference_continuations(target, prompts, a.max_new_tokens, stops, ref_path)
        rows = replay_rows(target, labels, drafts, budgets, prompts, refs, a.max_new_tokens, stops, t0)
    else:
        rows = _decode_rows(target, labels, drafts, budgets, prompts, a.max_new_tokens, stops, a.check_ar, t0)
    summary = _summarise(rows, labels, budgets, a.replay, a.check_ar)
    from dflash_core.timing import cpu_model

    cpu = cpu_model()
    result = {"summary": summary, "rows": rows, "dtype": str(dtype), "cpu": cpu, "threads": torch.get_num_threads(),
              "max_new_tokens": a.max_new_tokens, "prompts": len(prompts),
              "mode": "replay" if a.replay else "decode loop"}
    print(f"tau ({'replayed' if a.replay else 'decode loop'}, greedy, {a.max_new_tokens} tokens, {len(prompts)} "
          f"prompts, {dtype}, {cpu}):")
    for key, entry in summary.items():
        print(f"  {key:40s} " + "  ".join(f"{g} {v:.3f}" if isinstance(v, float) else f"{g} {v}"
                                          for g, v in entry.items()))
    if a.out:
        from experiments.bench.schema import write_json_atomic

        write_json_atomic(a.out, result)


if __name__ == "__main__":
    main()
