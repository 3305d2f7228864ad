"""Sampled against top-K trees at T = 1, with and without the drafter's Markov head, live on the default pair.

``python -m experiments.studies.sampled_head_study [--limit N] [--seeds 2] [--max-new-tokens 96] [--budget 16]
[--draft-temps 1.0,1.25,1.5] [--dtype fp32] [--out runs/sampled-head-study.json]``

The question: the shipped drafter has a gated Markov head, and with it DDTree's sampled trees (children drawn without
replacement from each node's conditioned row, recursive rejection) accept only ~1.06x the tau of the top-K tree at
B = 16, where before the head it was ~1.10x. Hypothesis: the head sharpens the drafter's distributions q beyond the
target's T = 1 distributions p, which helps the top-K tree's ranking but leaves a sampled tree less to gain; a draft
temperature > 1 (still exact: the rule runs with the q actually drawn from) would give it back. Answer measured on
2026-12-05 (docs/results.md): the ratio is 1.11 with the head and without it, and the drafter's root distribution is
flatter than the target's, not sharper; draft temperatures 0.85-1.25 are equal within noise.

Live decoding (``ddtree_generate(..., policy=...)``) of the fixed 24-prompt protocol (``drafter_eval``) at temperature
1, for these variants, interleaved per prompt and seed (the order rotates), each run seeded alike per (prompt, seed):

* ``topk+head``: the top-K tree as ``make_policy`` builds it (the Markov head's conditioned tree);
* ``topk-nohead``: the same policy handed the round's block without its scorer (:class:`WithoutHead`), so the tree
  comes from the per-depth base logits alone;
* ``sampled+head@T``: ``SampledTreePolicy(draft_temperature=T)`` for each ``--draft-temps`` entry;
* ``sampled-nohead@1``: the sampled tree at draft temperature 1 without the scorer.

Reported per variant: tau (committed tokens per round, pooled over rounds), tokens/s (committed tokens over the loop's
seconds), and each sampled variant's tau over the top-K tau of the same head setting, with a paired percentile
bootstrap 95% interval over prompts (seed 0; the statistic is the pooled ratio, so the point lies in it).

Mechanism, no extra decoding: for every round of the top-K runs (``--mechanism all``: of every run) one teacher-forced
target forward over prompt + generated tokens gives p at each round's root (the same distribution the live verify
computed there, up to rounding), and one batched drafter pass (``dflash_core.replay.draft_hidden_all_rounds``, the
drafter's context at each root exactly as live) gives the round's block (``decoding.make_block``). Per round: entropy
of p (full vocabulary), of q with the head (the scorer's row after the root token) and without (``block.logits[0]``),
the overlap sum_x min(p(x), q(x)) (the probability that a sampled tree's first root child is accepted; q lives on the
draft vocabulary, ``block.token_map`` maps it to target ids, so p's mass outside it is reported too), the overlap of
the head's row tempered by each draft temperature, and q's top-1 probability against p's mass on that token (q's
over-confidence at its favourite).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ddtree import ddtree_generate
from ddtree.generate import make_policy
from ddtree.sampled import SampledTreePolicy
from dflash_core.decoding import make_block
from dflash_core.policy import BlockPolicy, DraftBlock
from dflash_core.replay import draft_hidden_all_rounds
from dflash_core.target import TargetAdapter, tapped_forward
from experiments.bench.schema import bootstrap_ci

__all__ = ["Variant", "WithoutHead", "entropy", "make_variants", "overlap", "paired_ratio", "root_agreement",
           "run_study", "summarise"]


# ---------------------------------------------------------------------------------------------------- variants
class WithoutHead(BlockPolicy):
    """``inner`` handed each round's block without its Markov scorer: the tree comes from the base logits alone
    (the drafter still runs the head's gate when building the block; that costs one small product per round)."""

    def __init__(self, inner: BlockPolicy) -> None:
        self.inner, self.uses_draft, self.name = inner, inner.uses_draft, f"{inner.name}-nohead"

    def propose(self, block: DraftBlock | None, history: list[int]):
        if block is not None and block.scorer is not None:
            block = dataclasses.replace(block, scorer=None)
        return self.inner.propose(block, history)

    def observe(self, path: list[int]) -> None:
        self.inner.observe(path)

    def wants_draft(self, history: list[int]) -> bool:
        return self.inner.wants_draft(history)


@dataclass(frozen=True)
class Variant:
    name: str
    tree: str  # "topk" or "sampled"
    head: bool
    draft_temperature: float | None = None  # sampled trees only

    @property
    def baseline(self) -> str:
        """The top-K variant with the same head setting (what a sampled variant's ratio divides by)."""
        return "topk+head" if self.head else "topk-nohead"

    def policy(self, draft, budget: int, temperature: float, seed: int) -> BlockPolicy:
        if self.tree == "topk":
            inner = make_policy(budget, tree="topk", temperature=temperature)
        else:
            inner = SampledTreePolicy(budget, temperature, seed=seed, draft_temperature=self.draft_temperature,
                                      token_map=getattr(draft, "draft_vocab", None))
        return inner if self.head else WithoutHead(inner)


def make_variants(draft_temps) -> list[Variant]:
    return ([Variant("topk+head", "topk", True), Variant("topk-nohead", "topk", False)]
            + [Variant(f"sampled+head@{t:g}", "sampled", True, float(t)) for t in draft_temps]
            + [Variant("sampled-nohead@1", "sampled", False, 1.0)])


# ---------------------------------------------------------------------------------------------------- mechanism
def entropy(probs: torch.Tensor) -> float:
    """Entropy in nats of a probability vector (0 log 0 = 0)."""
    return float(torch.special.entr(probs.double()).sum())


def overlap(p: torch.Tensor, q: torch.Tensor, token_map: torch.Tensor | None = None) -> float:
    """sum_x min(p(x), q(x)): p [V] over the target's vocabulary, q [V'] over the draft vocabulary (column j is
    token ``token_map[j]``; None: the same vocabulary). Tokens outside the draft vocabulary have q = 0."""
    p_on_q = p.double() if token_map is None else p.double()[token_map.to(p.device)]
    return float(torch.minimum(p_on_q, q.double().to(p.device)).sum())


def _round_stats(p: torch.Tensor, block: DraftBlock, draft_temps) -> dict[str, float]:
    """One round's depth-1 agreement between the drafter's root row(s) and the target's p at the root."""
    base = block.logits[0].double()
    head = base if block.scorer is None else block.scorer.logits(1, [block.root])[0].double().to(base.device)
    token_map = None if block.token_map is None else block.token_map.to(p.device)
    on_draft = p if token_map is None else p[token_map]
    out = {"entropy_p": entropy(p), "p_outside_draft_vocab": max(0.0, 1.0 - float(on_draft.sum()))}
    for label, logits in (("head", head), ("nohead", base)):
        q = torch.softmax(logits, dim=-1)
        top = int(q.argmax())
        out[f"entropy_q_{label}"] = entropy(q)
        out[f"overlap_{label}"] = overlap(p, q, token_map)
        out[f"q_top1_{label}"] = float(q[top])
        out[f"p_at_q_top1_{label}"] = float(on_draft[top])
    for t in draft_temps:
        out[f"overlap_head@{t:g}"] = overlap(p, torch.softmax(head / float(t), dim=-1), token_map)
    return out


@torch.inference_mode()
def root_agreement(target, draft, prompt: list[int], new_tokens: list[int], acceptance: list[int],
                   temperature: float, draft_temps) -> dict:
    """Sums over the rounds of a run (roots at prompt_len + committed-so-far) of :func:`_round_stats`, and ``rounds``:
    teacher-forced p and the drafter's blocks (the replay's batched pass), no decoding."""
    if not acceptance or not new_tokens:
        return {"rounds": 0}
    start = len(prompt)
    ids = torch.tensor(list(prompt) + list(new_tokens), dtype=torch.long)
    hidden = draft_hidden_all_rounds(target, draft, ids, start)  # [T - start, b-1, H]
    adapter = TargetAdapter(target, ())
    logits = tapped_forward(target, ids[None].to(adapter.device), (), use_cache=False).logits[0]  # [T, V]
    sums: dict[str, float] = {}
    position = start
    for length in acceptance:
        root = int(ids[position])
        p = torch.softmax(logits[position].double() / temperature, dim=-1)
        block = make_block(draft, adapter, hidden[position - start, :1].to(adapter.device), root)  # depth 1 only
        for key, value in _round_stats(p, block, draft_temps).items():
            sums[key] = sums.get(key, 0.0) + value
        position += length
    return {"rounds": len(acceptance), **sums}


# ---------------------------------------------------------------------------------------------------- the runs
def _run_row(target, draft, ids: list[int], variant: Variant, budget: int, temperature: float,
             max_new_tokens: int, stops, seed: int) -> tuple[dict, object]:
    policy = variant.policy(draft, budget, temperature, seed)
    res = ddtree_generate(target, draft, torch.tensor([ids]), policy=policy, max_new_tokens=max_new_tokens,
                          temperature=temperature, stop_token_ids=stops, seed=seed)
    t = res.timings
    row = {"variant": variant.name, "rounds": len(res.acceptance_lengths), "tokens": sum(res.acceptance_lengths),
           "new_tokens": len(res.new_token_ids), "mean_tree_size": sum(res.tree_sizes) / max(1, len(res.tree_sizes)),
           "decode_s": t.get("decode", 0.0), "draft_s": t.get("draft", 0.0), "tree_s": t.get("tree", 0.0),
           "verify_s": t.get("verify", 0.0)}
    return row, res


def run_study(target, draft, prompts, seeds: int = 2, budget: int = 16, draft_temps=(1.0, 1.25, 1.5),
              temperature: float = 1.0, max_new_tokens: int = 96, stops=(), mechanism: str = "topk",
              log=print) -> tuple[list[dict], list[dict]]:
    """(decode rows, mechanism rows) for ``prompts`` [(group, dataset, sample_id, prompt ids)]: every variant per
    prompt and seed, in an order that rotates; run seed = 1000 * seed + prompt index (loop and tree draws alike, so
    the variants of one (prompt, seed) share their first token). ``mechanism``: "topk", "all" or "none"."""
    variants = make_variants(draft_temps)
    rows, mech = [], []
    t0 = time.perf_counter()
    for index, (group, dataset, sid, ids) in enumerate(prompts):
        for seed in range(seeds):
            run_seed = 1000 * seed + index
            shift = (index + seed) % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                key = {"group": group, "dataset": dataset, "sample_id": sid, "prompt_index": index, "seed": seed,
                       "run_seed": run_seed}
                row, res = _run_row(target, draft, ids, variant, budget, temperature, max_new_tokens, stops, run_seed)
                rows.append({**key, **row})
                if mechanism == "all" or (mechanism == "topk" and variant.tree == "topk"):
                    sums = root_agreement(target, draft, ids, res.new_token_ids, res.acceptance_lengths, temperature,
                                          draft_temps)
                    mech.append({**key, "variant": variant.name, **sums})
        mine = [r for r in rows if r["prompt_index"] == index]
        taus = "  ".join(f"{v.name} {_tau([r for r in mine if r['variant'] == v.name]):.2f}" for v in variants)
        log(f"[{time.perf_counter() - t0:.0f}s] {group}/{dataset}/{sid}: {taus}")
    return rows, mech


# ---------------------------------------------------------------------------------------------------- summary
def _tau(rows: list[dict]) -> float:
    return sum(r["tokens"] for r in rows) / max(1, sum(r["rounds"] for r in rows))


def _pooled_ratio(values) -> float:
    """(tokens_a, rounds_a, tokens_b, rounds_b) per prompt -> pooled tau_a / pooled tau_b."""
    tau_a = sum(v[0] for v in values) / max(1, sum(v[1] for v in values))
    tau_b = sum(v[2] for v in values) / max(1, sum(v[3] for v in values))
    return tau_a / tau_b if tau_b > 0 else float("nan")


def paired_ratio(rows: list[dict], name: str, baseline: str, seed: int = 0) -> dict:
    """tau of ``name`` over tau of ``baseline`` (pooled over rounds) with a paired bootstrap 95% interval over
    prompts (each prompt's seeds stay together; fixed ``seed``)."""
    per_prompt: dict[int, list[int]] = {}
    for r in rows:
        if r["variant"] in (name, baseline):
            slot = per_prompt.setdefault(r["prompt_index"], [0, 0, 0, 0])
            offset = 0 if r["variant"] == name else 2
            slot[offset] += r["tokens"]
            slot[offset + 1] += r["rounds"]
    values = [tuple(v) for v in per_prompt.values() if v[1] and v[3]]
    if not values:
        return {"ratio": None, "lo": None, "hi": None, "prompts": 0}
    point = _pooled_ratio(values)
    lo, hi = bootstrap_ci(values, statistic=_pooled_ratio, seed=seed)
    return {"ratio": point, "lo": lo, "hi": hi, "prompts": len(values)}


def summarise(rows: list[dict], mech: list[dict], draft_temps) -> dict:
    """Per variant: tau, tokens/s, rounds, the ratio to its top-K baseline (sampled variants) and the mechanism's
    per-round means (variants whose text was analysed)."""
    summary = {}
    for variant in make_variants(draft_temps):
        mine = [r for r in rows if r["variant"] == variant.name]
        if not mine:
            continue
        seconds = sum(r["decode_s"] for r in mine)
        entry = {"tau": _tau(mine), "rounds": sum(r["rounds"] for r in mine), "runs": len(mine),
                 "tokens_per_s": sum(r["tokens"] for r in mine) / seconds if seconds > 0 else None,
                 "mean_tree_size": sum(r["mean_tree_size"] * r["rounds"] for r in mine) / max(1, sum(
                     r["rounds"] for r in mine))}
        if variant.tree == "sampled":
            entry["vs_" + variant.baseline] = paired_ratio(rows, variant.name, variant.baseline)
        analysed = [m for m in mech if m["variant"] == variant.name and m["rounds"]]
        if analysed:
            n = sum(m["rounds"] for m in analysed)
            keys = [k for k in analysed[0] if k not in ("rounds", "variant", "group", "dataset", "sample_id",
                                                         "prompt_index", "seed", "run_seed")]
            entry["mechanism"] = {"rounds": n, **{k: sum(m[k] for m in analysed) / n for k in keys}}
        summary[variant.name] = entry
    return summary


def table(summary: dict) -> str:
    lines = ["variant               tau    ratio vs top-K [95%]        tok/s   nodes/round"]
    for name, e in summary.items():
        ratio = next((v for k, v in e.items() if k.startswith("vs_")), None)
        text = "" if ratio is None or ratio["ratio"] is None else \
            f"{ratio['ratio']:.3f} [{ratio['lo']:.3f}, {ratio['hi']:.3f}]"
        tps = "n/a" if e["tokens_per_s"] is None else f"{e['tokens_per_s']:.1f}"
        lines.append(f"{name:20s} {e['tau']:6.3f}  {text:26s} {tps:>7s}   {e['mean_tree_size']:.1f}")
    mech = {k: e["mechanism"] for k, e in summary.items() if "mechanism" in e}
    if mech:
        lines += ["", "depth-1 agreement at the round roots (means over rounds; entropies in nats; overlap = "
                  "sum min(p, q))", "text of             H(p)  H(q head) H(q nohead) ovl head ovl nohead "
                  "q1 head p@q1 head q1 nohead p@q1 nohead p outside"]
        for name, m in mech.items():
            lines.append(f"{name:18s} {m['entropy_p']:5.2f}  {m['entropy_q_head']:8.2f} {m['entropy_q_nohead']:10.2f} "
                         f"{m['overlap_head']:8.3f} {m['overlap_nohead']:10.3f} {m['q_top1_head']:7.3f} "
                         f"{m['p_at_q_top1_head']:9.3f} {m['q_top1_nohead']:9.3f} {m['p_at_q_top1_nohead']:11.3f} "
                         f"{m['p_outside_draft_vocab']:9.3f}")
            temps = "  ".join(f"T={k.split('@')[1]}: {v:.3f}" for k, v in m.items() if k.startswith("overlap_head@"))
            lines.append(f"{'':18s} overlap of the head's row at draft temperature  {temps}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.studies.sampled_head_study",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=None, help="only the first N protocol prompts")
    p.add_argument("--seeds", type=int, default=2, help="seeds per prompt (0..N-1)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--draft-temps", default="1.0,1.25,1.5", help="sampled+head draft temperatures")
    p.add_argument("--temperature", type=float, default=1.0, help="decoding temperature (the question is T = 1)")
    p.add_argument("--mechanism", choices=["topk", "all", "none"], default="topk",
                   help="whose rounds get the teacher-forced depth-1 agreement")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: the machine's")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="runs/sampled-head-study.json")
    a = p.parse_args(argv)
    a.draft_temps = tuple(float(t) for t in a.draft_temps.split(",") if t.strip())
    if a.temperature <= 0:
        p.error("sampled trees need --temperature > 0")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from dflash_core import load_default_pair
    from dflash_core.default import resolve_device, stop_token_ids
    from dflash_core.timing import cpu_model, machine_identity
    from experiments.bench.models import resolve_dtype
    from experiments.bench.schema import git_commit, package_versions, write_json_atomic
    from experiments.studies.drafter_eval import protocol_prompts

    device = resolve_device(a.device)
    dtype = resolve_dtype(a.dtype or "auto", device)
    target, draft, tokenizer = load_default_pair(dtype, device)
    prompts = protocol_prompts(tokenizer)[: a.limit]
    t0 = time.perf_counter()
    rows, mech = run_study(target, draft, prompts, a.seeds, a.budget, a.draft_temps, a.temperature,
                           a.max_new_tokens, stop_token_ids(tokenizer), a.mechanism)
    summary = summarise(rows, mech, a.draft_temps)
    head = getattr(draft, "markov", None)
    print(f"\nT = {a.temperature:g}, budget {a.budget}, {len(prompts)} prompts x {a.seeds} seeds, {a.max_new_tokens} "
          f"new tokens, {dtype}, {device}, {cpu_model()}, {torch.get_num_threads()} threads "
          f"({time.perf_counter() - t0:.0f} s)\n")
    print(table(summary))
    result = {"command": [sys.executable, "-m", "experiments.studies.sampled_head_study", *sys.argv[1:]],
              "machine": machine_identity(), "device": str(device), "dtype": str(dtype),
              "versions": package_versions(), "commit": git_commit(),
              "settings": {k: v for k, v in vars(a).items()},
              "markov_head": None if head is None else {"kind": head.kind, "rank": head.rank},
              "seconds": time.perf_counter() - t0, "summary": summary, "rows": rows,
              "mechanism_rows_note": "sums over each run's rounds: divide by rounds", "mechanism_rows": mech}
    write_json_atomic(Path(a.out), result)
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
