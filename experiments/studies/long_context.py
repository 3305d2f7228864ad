"""Cost against context length: ``python -m experiments.studies.long_context``.

For each context length: plain decoding's step (milliseconds per token after the prefill), the prefill rate (prompt
tokens per second: the median of ``--prefill-repeats`` prefills, every context's in turn before anything else is
timed, so that a slow phase of the machine does not land on one context's single prefill) and, unless ``--methods``
leaves them out, DDTree at the given budgets (tokens per second over plain decoding's, tau, and whether the output
equals plain decoding's). Methods run one after another on the same prompt; ``auto``'s cost curves are measured for
every context's bucket before anything is timed. The prompt is the end of this repository's docs (README,
docs/*.md) cut to the context length, as one user message with a summary request (``--text random``: random token
ids, plain decoding only makes sense then). The embedded pair by default, with the CPU linear kernels the benchmark
applies (``--pair tiny``: a random tiny pair, for smoke runs).

Each finished context is one JSON line in ``--out``; the file is rewritten atomically after each, and a rerun skips
the contexts it already holds (a rerun whose settings differ from its records is refused). After the last context,
``summary.json`` and ``summary.md`` beside it hold the table (context, plain step, prefill rate, tokens per second
and speedup per method); ``python -m plots.long_context_figure`` draws it. ``bash run_benchmark.sh --preset long``
runs it with answers of 1,024 tokens at 100 to 6,000 tokens of context and draws the figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from ddtree import ddtree_generate
from ddtree.cost import calibrate
from dflash_core import autoregressive_generate
from dflash_core.timing import cpu_model
from experiments.bench.schema import write_text_atomic

REPO = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/results.md", "docs/architecture.md")


def docs_prompt(tokenizer, context: int) -> torch.Tensor:
    """[1, T] chat prompt: the last ``context`` tokens of the repository's docs and a request to summarize them."""
    text = "\n\n".join((REPO / name).read_text(encoding="utf-8") for name in DOCS if (REPO / name).is_file())
    body = tokenizer(text, add_special_tokens=False).input_ids
    if len(body) < context:
        raise ValueError(f"the docs hold {len(body)} tokens, fewer than the asked context {context}")
    message = tokenizer.decode(body[-context:]) + "\n\nSummarize the text above in a few sentences."
    ids = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                        return_tensors="pt")
    return ids if isinstance(ids, torch.Tensor) else ids["input_ids"]


def prefill_rates(target, prompts: dict[int, torch.Tensor], repeats: int) -> dict[int, float]:
    """{context: prompt tokens per second}: the median of ``repeats`` prefills of each prompt, the prompts in turn
    (forwards, then backwards)."""
    seconds: dict[int, list[float]] = {c: [] for c in prompts}
    order = list(prompts)
    for r in range(repeats):
        for c in order if r % 2 == 0 else order[::-1]:
            seconds[c].append(autoregressive_generate(target, prompts[c], max_new_tokens=1).timings["prefill"])
    return {c: int(prompts[c].shape[1]) / statistics.median(s) for c, s in seconds.items()}


def measure(target, draft, ids: torch.Tensor, budgets: list, max_new_tokens: int) -> dict:
    """One context: plain decoding's step and its prefill's rate, then each DDTree budget against it."""
    plain = autoregressive_generate(target, ids, max_new_tokens=max_new_tokens)
    decode = plain.timings["decode"]
    record = {"context": int(ids.shape[1]), "plain_step_ms": 1e3 * decode / max(1, len(plain.acceptance_lengths)),
              "prefill_tok_s": ids.shape[1] / plain.timings["prefill"],
              "plain_tok_s": len(plain.new_token_ids) / decode}
    for budget in budgets:
        r = ddtree_generate(target, draft, ids, budget=budget, max_new_tokens=max_new_tokens)
        tok_s = len(r.new_token_ids) / r.timings["decode"]
        record[f"ddtree_{budget}"] = {"tok_s": tok_s, "speedup": tok_s / record["plain_tok_s"], "tau": r.tau,
                                      "same_as_plain": r.new_token_ids == plain.new_token_ids}
    return record


def run(target, draft, prompt_for, contexts: list[int], budgets: list, max_new_tokens: int, out: Path,
        machine: dict, prefill_repeats: int = 3) -> list[dict]:
    """Measure every context not yet in ``out`` (``prompt_for(context) -> [1, T]``), rewriting it after each. The
    prefill rates of the contexts to measure come first (:func:`prefill_rates`; ``prefill_repeats`` 0: each
    context's plain call's own prefill)."""
    done = [json.loads(line) for line in out.read_text().splitlines() if line.strip()] if out.is_file() else []
    _check_resumable(done, machine, budgets, out)
    have = {r["asked_context"] for r in done}
    autoregressive_generate(target, prompt_for(min(contexts))[:, :32], max_new_tokens=4)  # warm-up
    todo = [c for c in contexts if c not in have]
    if todo and any(b in ("auto", "chain-auto") for b in budgets):  # auto's curves, before anything is timed
        for chain in sorted({b == "chain-auto" for b in budgets if b in ("auto", "chain-auto")}):
            calibrate(target, draft, contexts=[int(prompt_for(c).shape[1]) for c in todo], chain=chain)
    rates = prefill_rates(target, {c: prompt_for(c) for c in todo}, prefill_repeats) if prefill_repeats else {}
    for context in contexts:
        if context in have:
            continue
        record = {"asked_context": context, **measure(target, draft, prompt_for(context), budgets, max_new_tokens),
                  **machine}
        if context in rates:  # the interleaved median; the plain call's own prefill stays beside it
            record["prefill_once_tok_s"], record["prefill_tok_s"] = record["prefill_tok_s"], rates[context]
        print(json.dumps(record), flush=True)
        done.append(record)
        write_text_atomic(out, "".join(json.dumps(r) + "\n" for r in done))
    return done


def _check_resumable(done: list[dict], machine: dict, budgets: list, out: Path) -> None:
    """A rerun adds contexts to ``out`` only where its records were measured as this run would measure them (the
    same CPU, dtype, prompt text and answer length, and every budget asked now); else a clear error."""
    for r in done:
        differ = [f"{k} {r.get(k)!r} there, {v!r} now" for k, v in machine.items() if r.get(k) != v]
        differ += [f"no DDTree budget {b} there" for b in budgets if f"ddtree_{b}" not in r]
        if differ:
            raise ValueError(f"{out} holds context {r.get('asked_context')} measured with other settings ("
                             + "; ".join(differ) + "): pass another --out, or delete the file to measure anew")


def summarize(records: list[dict], budgets: list) -> dict:
    """The study's table as one record: a row per context (ascending) with plain decoding's step, prefill rate and
    tokens per second, and per DDTree budget its tokens per second, speedup, tau and equality to plain decoding."""
    rows = []
    for r in sorted(records, key=lambda r: r["context"]):
        row = {k: r[k] for k in ("context", "plain_step_ms", "prefill_tok_s", "plain_tok_s")}
        row["methods"] = {f"ddtree_{b}": r[f"ddtree_{b}"] for b in budgets if f"ddtree_{b}" in r}
        rows.append(row)
    first = records[0] if records else {}
    return {"machine": {"cpu": first.get("cpu", ""), "dtype": first.get("dtype", "")},
            "settings": {"text": first.get("text"), "max_new_tokens": first.get("max_new_tokens"),
                         "budgets": [str(b) for b in budgets]}, "rows": rows}


def markdown(summary: dict) -> str:
    """``summary.md``: one line per context."""
    names = sorted({m for row in summary["rows"] for m in row["methods"]})
    head = ["context", "plain step (ms)", "prefill (tok/s)", "plain (tok/s)"]
    head += [f"{n.removeprefix('ddtree_')}: tok/s, speedup, tau, same" for n in names]
    lines = [f"Long contexts: {summary['machine']['cpu']}, {summary['machine']['dtype']}, "
             f"{summary['settings']['max_new_tokens']} new tokens, DDTree budgets {', '.join(names)}", "",
             "| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for row in summary["rows"]:
        cells = [str(row["context"]), f"{row['plain_step_ms']:.1f}", f"{row['prefill_tok_s']:.0f}",
                 f"{row['plain_tok_s']:.2f}"]
        for n in names:
            m = row["methods"].get(n)
            cells.append("-" if m is None else f"{m['tok_s']:.2f}, {m['speedup']:.2f}x, {m['tau']:.2f}, "
                                               f"{'yes' if m['same_as_plain'] else 'no'}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_summary(records: list[dict], budgets: list, out: Path) -> Path:
    """``summary.json`` and ``summary.md`` beside ``out`` (atomically); the JSON's path."""
    summary = summarize(records, budgets)
    path = out.with_name("summary.json")
    write_text_atomic(path, json.dumps(summary, indent=2))
    write_text_atomic(out.with_name("summary.md"), markdown(summary))
    return path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments.studies.long_context", description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", choices=["default", "tiny"], default="default")
    p.add_argument("--contexts", default="100,1000,3000,6000")
    p.add_argument("--methods", default="16,auto", help="DDTree budgets (ints, auto), comma-separated; '' for none")
    p.add_argument("--text", choices=["docs", "random"], default="docs")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prefill-repeats", type=int, default=3,
                   help="prefills per context, every context's in turn, whose median is the prefill rate (0: the "
                        "plain call's one prefill)")
    p.add_argument("--out", default="runs/long_context.jsonl")
    a = p.parse_args(argv)
    contexts = [int(x) for x in a.contexts.split(",") if x.strip()]
    budgets = [m if m == "auto" else int(m) for m in a.methods.split(",") if m.strip()]
    if a.pair == "tiny":
        from experiments.bench.models import random_draft, tiny_target

        target = tiny_target()
        draft, tokenizer = random_draft(target, layers=1, taps=2, block_size=8), None
    else:
        from dflash_core import load_default_pair
        from dflash_core.cpu_kernels import apply_cpu_kernels

        target, draft, tokenizer = load_default_pair()
        apply_cpu_kernels(target, draft, kernels="auto")
    if tokenizer is None and a.text == "docs":
        p.error("--pair tiny has no tokenizer: use --text random")
    g = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    prompt_for = (lambda n: docs_prompt(tokenizer, n)) if a.text == "docs" else \
        (lambda n: torch.randint(0, vocab, (1, n), generator=g))
    machine = {"cpu": cpu_model(), "dtype": str(next(target.parameters()).dtype), "text": a.text,
               "max_new_tokens": a.max_new_tokens}
    records = run(target, draft, prompt_for, contexts, budgets, a.max_new_tokens, Path(a.out), machine,
                  a.prefill_repeats)
    print(f"summary: {write_summary([r for r in records if r['asked_context'] in contexts], budgets, Path(a.out))}")


if __name__ == "__main__":
    main()
