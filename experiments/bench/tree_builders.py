"""Tree builders side by side on one drafter: ``bash run_benchmark.sh --preset baselines``
(``python -m experiments.bench.tree_builders``).

Every builder proposes from the same drafter block and is verified by the same target pass, at equal node budgets:

    ddtree      the best-first top-K tree (the toolkit's own)
    eagle2      EAGLE-2's expand-then-rerank (:class:`ddtree.baselines.EagleTwoTree`)
    sequoia     Sequoia's static tree from per-depth, per-rank acceptance (:class:`ddtree.baselines.SequoiaTree`)
    medusa      a Medusa-style static tree grown greedily by path accuracy (:class:`ddtree.baselines.MedusaTree`)
    dflash      the drafter's chain (one row per temperature, no budget: the reference every tree should beat)

and at T > 0 also the sampled trees, which verify by rejection sampling:

    sampled     children drawn without replacement, recursive rejection (:class:`ddtree.sampled.SampledTreePolicy`)
    traversal   the same sampled trees, verified leaf to root (:class:`ddtree.multidraft.TraversalVerified`)
    specinfer   k independent sampled chains merged into a tree, SpecInfer's multi-draft rule
                (:class:`ddtree.multidraft.SpecInferTree`; ``chains_for(budget)`` chains)

Two forms, one record schema (``rows.jsonl``, one line per prompt x method x budget x temperature x form):

* **replay** (many prompts, no target rounds): plain decoding's continuation of each prompt is computed once per
  temperature; every deterministic builder's rounds are replayed on it from one batched drafter pass
  (:mod:`dflash_core.replay`; at T > 0 the rounds of sample-and-match decoding under the coupling in which the target
  draws exactly plain decoding's tokens) and priced with this machine's measured round-cost curve. Sampled trees are
  not replayable (their acceptance depends on the target's whole distribution at each node) and run live only.
* **live** (fewer prompts): every method decodes for real; tokens/s over plain decoding's on the same prompt, and at
  T = 0 whether the output equals plain decoding's.

Sequoia's and Medusa's tables are fitted (:func:`ddtree.baselines.fit_rank_acceptance`) from replayed rounds on
CALIBRATION prompts of the same datasets that are not evaluation prompts (the tail of each dataset's fixed
selection), once per temperature; the tables are stored in ``calibration.json``.

The summary (``summary.json``, ``summary.md``) gives per form, temperature, budget and method: tau (committed tokens
per round, pooled), tau per verified node (tree efficiency), the speedup over plain decoding (geometric mean over
prompts) and the per-prompt paired ratio against DDTree at the same budget with a 95% bootstrap interval.
``python -m plots.tree_builders_figure`` draws it. Everything is written atomically after each prompt; rerunning
with the same ``--out`` skips what is there.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

__all__ = ["TREE_METHODS", "SAMPLED_METHODS", "chains_for", "make_method", "summarize", "main"]

TREE_METHODS = ("ddtree", "eagle2", "sequoia", "medusa")  # deterministic: replayed and live, any temperature
SAMPLED_METHODS = ("sampled", "traversal", "specinfer")  # T > 0 only, live only
RANKS = 8  # ranks per depth in Sequoia's and Medusa's acceptance tables


def log(message: str) -> None:
    print(f"[baselines] {message}", file=sys.stderr, flush=True)


def chains_for(budget: int) -> int:
    """SpecInfer's chain count at a node budget: 2 chains up to 16 nodes, then one chain per 8 nodes (so each chain
    is 4-8 tokens deep, within the drafter's block)."""
    return max(2, int(budget) // 8)


def make_method(method: str, budget: int | None, temperature: float, seed: int = 0, table=None):
    """The :class:`~dflash_core.tree.BlockPolicy` of ``method`` at ``budget`` nodes (``table``: the fitted rank
    acceptance that Sequoia and Medusa need)."""
    from ddtree.baselines import EagleTwoTree, MedusaTree, SequoiaTree
    from ddtree.generate import make_policy

    if method == "dflash":
        return make_policy("chain")
    if method == "ddtree":
        return make_policy(int(budget))
    if method == "eagle2":
        return EagleTwoTree(int(budget))
    if method in ("sequoia", "medusa"):
        if table is None:
            raise ValueError(f"{method} needs a fitted acceptance table (the calibration step)")
        return SequoiaTree(table, int(budget)) if method == "sequoia" else MedusaTree(table, int(budget))
    if not temperature > 0:
        raise ValueError(f"{method} samples its tree: it needs a temperature > 0")
    from ddtree.multidraft import SpecInferTree, TraversalVerified
    from ddtree.sampled import SampledTreePolicy

    if method == "sampled":
        return SampledTreePolicy(int(budget), temperature=temperature, seed=seed)
    if method == "traversal":
        return TraversalVerified(SampledTreePolicy(int(budget), temperature=temperature, seed=seed))
    if method == "specinfer":
        return SpecInferTree(chains_for(budget), budget=int(budget), temperature=temperature, seed=seed)
    raise ValueError(f"unknown method {method!r}; expected dflash, {', '.join(TREE_METHODS + SAMPLED_METHODS)}")


# ------------------------------------------------------------------------------------------------ the record file
class Rows:
    """``rows.jsonl``: every finished row, rewritten atomically; ``done(key)`` for resuming."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict] = []
        if path.is_file():
            self.rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        self.keys = {self.key(r) for r in self.rows}

    @staticmethod
    def key(row: dict) -> tuple:
        return (row["form"], row["temperature"], row["dataset"], row["sample_id"], row["method"], row["budget"])

    def done(self, **fields) -> bool:
        return self.key(fields) in self.keys

    def add(self, rows: list[dict]) -> None:
        from experiments.bench.schema import write_text_atomic

        fresh = [r for r in rows if self.key(r) not in self.keys]
        self.rows += fresh
        self.keys |= {self.key(r) for r in fresh}
        if fresh:
            write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in self.rows))


def _row(form: str, temperature: float, label: dict, method: str, budget, lengths: Sequence[int],
         sizes: Sequence[int], seconds: float, ar_seconds: float, tokens: int, same_as_ar=None,
         max_new_tokens: int | None = None) -> dict:
    rounds = max(1, len(lengths))
    return {"form": form, "temperature": temperature, "dataset": label["dataset"], "sample_id": label["sample_id"],
            "method": method, "budget": budget, "tau": sum(lengths) / rounds, "committed": int(sum(lengths)),
            "rounds": len(lengths), "nodes": int(sum(sizes)), "tokens": int(tokens), "seconds": float(seconds),
            "ar_seconds": float(ar_seconds), "speedup": ar_seconds / seconds if seconds > 0 else None,
            "same_as_ar": same_as_ar, "max_new_tokens": max_new_tokens}


# ------------------------------------------------------------------------------------------------ the steps
def continuations(target, prompts, labels, max_new_tokens: int, stops, temperature: float, path: Path,
                  seed: int = 0) -> list[list[int]]:
    """Plain decoding's continuation of every prompt at ``temperature`` (cached in ``path``, per target)."""
    from experiments.studies.drafter_eval import reference_continuations

    entries = [("", lab["dataset"], lab["sample_id"], ids) for lab, ids in zip(labels, prompts)]
    refs: dict[str, list[int]] = {}
    for entry in entries:  # one at a time: the cache is rewritten after each, so an interruption keeps them
        refs = reference_continuations(target, [entry], max_new_tokens, stops, path, temperature, seed)
    return [refs[f"{lab['dataset']}/{lab['sample_id']}"] for lab in labels]


def fit_table(target, draft, prompts, outputs, max_new_tokens: int, stops, depth: int):
    """Sequoia's / Medusa's rank acceptance from the calibration prompts' replayed rounds (DDTree B=64's rounds)."""
    from ddtree.baselines import RecordRounds, fit_rank_acceptance
    from ddtree.generate import make_policy
    from dflash_core.replay import replay

    rounds = []
    for ids, out in zip(prompts, outputs):
        if len(out) < 2:
            continue
        full = torch.tensor(list(ids) + list(out))
        recorder = RecordRounds(make_policy(64))
        replay(target, draft, recorder, full, len(ids), max_new_tokens, stops)
        rounds += recorder.rounds(full)
    return fit_rank_acceptance(rounds, depth, RANKS), len(rounds)


def replay_prompt(target, draft, cost, ids, out, label, temperature, budgets, tables, max_new_tokens, stops,
                  rows: Rows) -> None:
    """Every deterministic builder (and the chain) replayed on one prompt's continuation, priced by ``cost``."""
    from dflash_core.replay import draft_hidden_all_rounds, replay
    from experiments.bench.replayer import round_seconds

    if len(out) < 2:
        return
    todo = [("dflash", None)] + [(m, b) for b in budgets for m in TREE_METHODS]
    todo = [(m, b) for m, b in todo if not rows.done(form="replay", temperature=temperature, dataset=label["dataset"],
                                                      sample_id=label["sample_id"], method=m, budget=b)]
    if not todo:
        return
    full = torch.tensor(list(ids) + list(out))
    hidden = draft_hidden_all_rounds(target, draft, full, len(ids))
    ar_seconds = (len(out) - 1) * float(cost.verify(0))
    got = []
    for method, budget in todo:
        policy = make_method(method, budget, temperature, table=tables.get(temperature))
        r = replay(target, draft, policy, full, len(ids), max_new_tokens, stops, hidden)
        seconds = round_seconds(cost, r.tree_sizes, drafted=True)
        got.append(_row("replay", temperature, label, method, budget, r.acceptance_lengths, r.tree_sizes, seconds,
                        ar_seconds, sum(r.acceptance_lengths), max_new_tokens=max_new_tokens))
    rows.add(got)


def live_prompt(target, draft, ids, label, temperature, methods, max_new_tokens, stops, seed, tables,
                rows: Rows) -> None:
    """Plain decoding and every (method, budget) decoded for real on one prompt (``tables``: {T: fitted table})."""
    from ddtree import ddtree_generate
    from dflash_core import autoregressive_generate

    todo = [(m, b) for m, b in methods if not rows.done(form="live", temperature=temperature,
                                                       dataset=label["dataset"], sample_id=label["sample_id"],
                                                       method=m, budget=b)]
    if not todo:
        return
    prompt = torch.tensor([list(ids)])
    plain = autoregressive_generate(target, prompt, max_new_tokens, temperature, stop_token_ids=stops, seed=seed)
    ar_per_token = plain.timings["decode"] / max(1, len(plain.new_token_ids) - 1)
    for method, budget in todo:  # one row at a time: a long prompt's finished methods survive an interruption
        policy = make_method(method, budget, temperature, seed, table=tables.get(temperature))
        r = ddtree_generate(target, draft, prompt, policy=policy, max_new_tokens=max_new_tokens,
                            temperature=temperature, stop_token_ids=stops, seed=seed)
        steps = max(1, len(r.new_token_ids) - 1)  # tokens after the prefill's, as plain decoding's steps
        same = r.new_token_ids == plain.new_token_ids if temperature == 0 else None
        rows.add([_row("live", temperature, label, method, budget, r.acceptance_lengths, r.tree_sizes,
                       r.timings["decode"], ar_per_token * steps, len(r.new_token_ids), same, max_new_tokens)])


# ------------------------------------------------------------------------------------------------ the summary
def _geomean(values: Sequence[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def summarize(rows: list[dict]) -> list[dict]:
    """One entry per (form, temperature, budget, method): prompts, tau (pooled), tau per verified node, speedup
    (geometric mean over prompts), and the paired ratios against DDTree at that budget (geometric mean of the
    per-prompt ratios, 95% bootstrap interval); the chain (budget None) is paired against every budget's DDTree in
    the figure, not here. At T = 0 live: outputs equal to plain decoding's."""
    from experiments.bench.schema import bootstrap_ci

    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["form"], r["temperature"], r["budget"], r["method"]), []).append(r)
    out = []
    for (form, temperature, budget, method), members in sorted(
            groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0, kv[0][3])):
        committed, rounds = sum(r["committed"] for r in members), sum(r["rounds"] for r in members)
        nodes = sum(r["nodes"] for r in members)
        tau = committed / max(1, rounds)
        speedups = [r["speedup"] for r in members if r["speedup"]]
        entry = {"form": form, "temperature": temperature, "budget": budget, "method": method,
                 "prompts": len(members), "tau": tau, "nodes_per_round": nodes / max(1, rounds),
                 "tau_per_node": tau / max(1e-9, nodes / max(1, rounds)),
                 "speedup": _geomean(speedups) if speedups else None}
        if form == "live" and temperature == 0:
            entry["same_as_ar"] = f"{sum(bool(r['same_as_ar']) for r in members)}/{len(members)}"
        base = {(r["dataset"], r["sample_id"]): r for r in groups.get((form, temperature, budget, "ddtree"), [])}
        pairs = [(r, base[(r["dataset"], r["sample_id"])]) for r in members
                 if (r["dataset"], r["sample_id"]) in base and method != "ddtree"]
        if pairs:
            tau_ratio = [a["tau"] / b["tau"] for a, b in pairs]
            speed_ratio = [a["speedup"] / b["speedup"] for a, b in pairs if a["speedup"] and b["speedup"]]
            entry["tau_vs_ddtree"] = [_geomean(tau_ratio), *bootstrap_ci(tau_ratio, _geomean)]
            if speed_ratio:
                entry["speedup_vs_ddtree"] = [_geomean(speed_ratio), *bootstrap_ci(speed_ratio, _geomean)]
        out.append(entry)
    return out


def markdown(summary: list[dict], machine: str) -> str:
    """The summary as Markdown tables, one per form and temperature."""
    def ci(v):
        return f"{v[0]:.3f} [{v[1]:.3f}, {v[2]:.3f}]" if v else "-"

    lines = [f"# Tree builders on one drafter ({machine})", ""]
    keys = sorted({(e["form"], e["temperature"]) for e in summary}, key=lambda k: (k[0] != "replay", k[1]))
    for form, temperature in keys:
        part = [e for e in summary if (e["form"], e["temperature"]) == (form, temperature)]
        n = max(e["prompts"] for e in part)
        lines += [f"## {form}, T = {temperature:g} (up to {n} prompts)", "",
                  "| budget | method | prompts | tau | nodes/round | tau/node | speedup | tau vs DDTree "
                  "| speedup vs DDTree |" + (" same as AR |" if form == "live" and temperature == 0 else ""),
                  "|---:|---|---:|---:|---:|---:|---:|---|---|" + ("---|" if form == "live" and temperature == 0
                                                                    else "")]
        for e in part:
            speed = f"{e['speedup']:.3f}" if e["speedup"] else "-"
            row = (f"| {e['budget'] if e['budget'] is not None else 'chain'} | {e['method']} | {e['prompts']} "
                   f"| {e['tau']:.3f} | {e['nodes_per_round']:.1f} | {e['tau_per_node']:.3f} | {speed} "
                   f"| {ci(e.get('tau_vs_ddtree'))} | {ci(e.get('speedup_vs_ddtree'))} |")
            if form == "live" and temperature == 0:
                row += f" {e.get('same_as_ar', '-')} |"
            lines.append(row)
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ main
def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise SystemExit(f"node budgets must be >= 1, got {text!r}")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.bench.tree_builders", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/baselines", help="folder for rows.jsonl, summary.{json,md}, the figure")
    p.add_argument("--pair", choices=["default", "tiny"], default="default",
                   help="the embedded SmolLM2 pair, or a random tiny pair (smoke runs)")
    p.add_argument("--datasets", default=None, help="comma-separated (default: the offline datasets)")
    p.add_argument("--budgets", default="8,16,32,64", help="node budgets (default 8,16,32,64)")
    p.add_argument("--temperatures", default="0,1", help="comma-separated (default 0,1)")
    p.add_argument("--replay-samples", type=int, default=9, help="replayed prompts per dataset (default 9)")
    p.add_argument("--calibration-samples", type=int, default=3,
                   help="calibration prompts per dataset, after the evaluation ones (default 3)")
    p.add_argument("--live-samples", type=int, default=6, help="live prompts per dataset (default 6; 0: none)")
    p.add_argument("--live-budgets", default=None, help="budgets run live (default: --budgets)")
    p.add_argument("--live-methods", default=None,
                   help="methods run live (default: all; T = 0 runs only the deterministic ones)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="replayed answer length (default 64)")
    p.add_argument("--live-max-new-tokens", type=int, default=32, help="live answer length (default 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = p.parse_args(argv)
    a.budgets = _ints(a.budgets)
    a.live_budgets = _ints(a.live_budgets) if a.live_budgets else a.budgets
    try:
        a.temperatures = [float(t) for t in a.temperatures.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"--temperatures: expected numbers, got {a.temperatures!r}") from None
    if any(t < 0 for t in a.temperatures) or not a.temperatures:
        raise SystemExit("--temperatures must be >= 0 (0 = greedy)")
    known = ("dflash",) + TREE_METHODS + SAMPLED_METHODS
    a.live_methods = [m for m in (a.live_methods or ",".join(known)).split(",") if m]
    bad = [m for m in a.live_methods if m not in known]
    if bad:
        raise SystemExit(f"--live-methods: unknown {bad}; choose from {', '.join(known)}")
    for name in ("replay_samples", "calibration_samples", "live_samples", "max_new_tokens", "live_max_new_tokens"):
        if getattr(a, name) < 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 0")
    if a.calibration_samples < 1 and a.replay_samples:
        raise SystemExit("--calibration-samples must be >= 1: Sequoia and Medusa are fitted on them")
    return a


def _load(pair: str):
    import transformers

    transformers.utils.logging.set_verbosity_error()
    if pair == "tiny":
        from experiments.bench.models import ByteTokenizer, random_draft, tiny_target

        target = tiny_target().float()
        return target, random_draft(target), ByteTokenizer(), [ByteTokenizer.eos_token_id]
    from dflash_core import load_default_pair
    from dflash_core.cpu_kernels import apply_cpu_kernels
    from dflash_core.default import default_dtype, stop_token_ids

    target, draft, tokenizer = load_default_pair(default_dtype(torch.device("cpu")), "cpu")
    apply_cpu_kernels(target, draft, kernels="auto")
    return target, draft, tokenizer, stop_token_ids(tokenizer)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from ddtree.cost import context_bucket, default_cap, measure_cost_model
    from dflash_core.timing import cpu_model
    from dflash_core.training.pools.catalog import OFFLINE_DATASETS, build_chat, select_items
    from experiments.bench.schema import write_json_atomic, write_text_atomic

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    target, draft, tokenizer, stops = _load(a.pair)
    machine = f"{cpu_model()}, {str(target.dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads"
    datasets = [d for d in (a.datasets or ",".join(OFFLINE_DATASETS)).split(",") if d]
    evaluation, calibration = [], []
    for name in datasets:
        items = select_items(name, a.replay_samples + a.calibration_samples, seed=0)
        if len(items) < a.replay_samples + a.calibration_samples:
            raise SystemExit(f"{name} has {len(items)} benchmark items, fewer than {a.replay_samples} evaluation + "
                             f"{a.calibration_samples} calibration prompts: lower --replay-samples")
        for i, item in enumerate(items):
            entry = ({"dataset": item.dataset, "sample_id": item.sample_id, "live": i < a.live_samples},
                     build_chat(tokenizer, item.turns[:1]))
            (evaluation if i < a.replay_samples else calibration).append(entry)
    log(f"{machine}; {len(evaluation)} evaluation prompts ({a.live_samples} live per dataset), {len(calibration)} "
        f"calibration prompts, budgets {a.budgets}, T {a.temperatures}")
    rows = Rows(out / "rows.jsonl")
    depth = int(draft.config.block_size) - 1
    calibration_file = out / "calibration.json"
    stored = json.loads(calibration_file.read_text()) if calibration_file.is_file() else {}
    cap = default_cap(torch.device("cpu"))
    t0 = time.perf_counter()
    tables: dict[float, Any] = {}
    for temperature in a.temperatures:
        key = f"{temperature:g}"
        if key not in stored:
            cal = continuations(target, [ids for _, ids in calibration], [lab for lab, _ in calibration],
                                a.max_new_tokens, stops, temperature, out / f"calibration-T{key}.json", a.seed)
            table, n = fit_table(target, draft, [ids for _, ids in calibration], cal, a.max_new_tokens, stops, depth)
            stored[key] = {"table": table, "rounds": n, "prompts": len(calibration)}
            write_json_atomic(calibration_file, stored)
            log(f"T={key}: rank acceptance fitted on {n} rounds of {len(calibration)} calibration prompts")
        tables[temperature] = tuple(tuple(r) for r in stored[key]["table"])
    for temperature in a.temperatures:  # replay: every evaluation prompt
        key = f"{temperature:g}"
        labels = [lab for lab, _ in evaluation]
        outs = continuations(target, [ids for _, ids in evaluation], labels, a.max_new_tokens, stops, temperature,
                             out / f"continuations-T{key}.json", a.seed)
        for (label, ids), cont in zip(evaluation, outs):
            cost = measure_cost_model(target, draft, context=context_bucket(len(ids)), cap=cap, extrapolate=True)
            replay_prompt(target, draft, cost, ids, cont, label, temperature, a.budgets, tables, a.max_new_tokens,
                          stops, rows)
        log(f"T={key}: replayed {len(evaluation)} prompts ({time.perf_counter() - t0:.0f} s so far)")
    for temperature in a.temperatures:  # live: the first prompts of each dataset
        methods = [("dflash", None)] if "dflash" in a.live_methods else []
        for b in a.live_budgets:
            methods += [(m, b) for m in TREE_METHODS + (SAMPLED_METHODS if temperature > 0 else ())
                        if m in a.live_methods]
        live = [(lab, ids) for lab, ids in evaluation if lab["live"]]
        if live and methods:
            ddtree_warm = make_method("ddtree", 16, temperature)
            from ddtree import ddtree_generate

            ddtree_generate(target, draft, torch.tensor([live[0][1]]), policy=ddtree_warm, max_new_tokens=8,
                            temperature=temperature, stop_token_ids=stops)  # untimed warm-up
        for label, ids in live:
            live_prompt(target, draft, ids, label, temperature, methods, a.live_max_new_tokens, stops, a.seed, tables,
                        rows)
        if live and methods:
            log(f"T={temperature:g}: {len(live)} prompts live ({time.perf_counter() - t0:.0f} s so far)")
    summary = summarize(rows.rows)
    settings = {k: v for k, v in vars(a).items() if k != "threads"}
    write_json_atomic(out / "summary.json", {"machine": machine, "settings": settings, "summary": summary,
                                             "calibration": {k: {"rounds": v["rounds"], "prompts": v["prompts"]}
                                                             for k, v in stored.items()}})
    write_text_atomic(out / "summary.md", markdown(summary, machine))
    log(f"done in {time.perf_counter() - t0:.0f} s: {out / 'summary.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
